"""The opt-in CPU seam: the same values as the plain model, in the CPU's form."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.test_util  # pylint: disable=unused-import
import numpy as np

from flaxformer_mini import cpu_kernels, decoding
from flaxformer_mini.config import get_config
from flaxformer_mini.training import create_train_state, train_step


def test_dense_product_is_x_times_kernel_gradients_included():
  layer = nn.Dense(7, dot_general=cpu_kernels.dot_general)
  x = jax.random.normal(jax.random.key(0), (2, 3, 5))
  params = layer.init(jax.random.key(1), x)['params']
  kernel, bias = params['kernel'], params['bias']
  np.testing.assert_allclose(layer.apply({'params': params}, x),
                             x @ kernel + bias, rtol=1e-6, atol=1e-6)
  weights = jax.random.normal(jax.random.key(2), (2, 3, 7))

  def loss(x, params):
    return jnp.sum(jnp.tanh(layer.apply({'params': params}, x)) * weights)

  def reference(x, params):
    return jnp.sum(jnp.tanh(x @ params['kernel'] + params['bias']) * weights)

  ours = jax.grad(loss, argnums=(0, 1))(x, params)
  autodiff = jax.grad(reference, argnums=(0, 1))(x, params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               ours, autodiff)
  # And against finite differences, not only against autodiff.
  jax.test_util.check_grads(loss, (x, params), order=1, modes=['rev'])


def test_the_kernel_gradient_multiplies_a_materialised_x_transposed():
  # Autodiff's product contracted over the tokens is slower on the CPU; the
  # barrier keeps XLA from folding the copy back into it.
  x = jnp.ones((6, 5))
  kernel_gradient = jax.grad(lambda kernel: jnp.sum(
      cpu_kernels.dot_general(x, kernel, (((1,), (0,)), ((), ())))))
  text = jax.jit(kernel_gradient).lower(jnp.ones((5, 7))).as_text()
  barriers = re.findall(
      r'(%\S+) = stablehlo\.optimization_barrier %\S+ : tensor<5x6xf32>', text)
  assert len(barriers) == 1
  assert re.search(rf'stablehlo\.dot_general {barriers[0]}, ', text)


def test_tied_logits_is_x_times_the_table_transposed_gradient_included():
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (2, 3, 8))
  table = jax.random.normal(keys[1], (11, 8))
  weights = jax.random.normal(keys[2], (2, 3, 11))
  np.testing.assert_allclose(cpu_kernels.tied_logits(x, table), x @ table.T,
                             rtol=1e-5, atol=1e-6)

  def loss(project):
    return lambda x, table: jnp.sum(jnp.tanh(project(x, table)) * weights)

  ours = jax.grad(loss(cpu_kernels.tied_logits), argnums=(0, 1))(x, table)
  autodiff = jax.grad(loss(lambda x, t: x @ t.T), argnums=(0, 1))(x, table)
  for a, b in zip(ours, autodiff):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  jax.test_util.check_grads(cpu_kernels.tied_logits, (x, table), order=1,
                            modes=['rev'])


def test_the_switch_changes_no_parameter_and_no_training_step(toy_batch):
  plain = get_config('toy')
  switched = plain.replace(cpu_kernels=True)
  state = create_train_state(plain, jax.random.key(0))
  other = create_train_state(switched, jax.random.key(0))
  jax.tree.map(np.testing.assert_array_equal, state.params, other.params)
  rng = jax.random.key(1)
  after, metrics = train_step(state, toy_batch, rng, plain)
  after_switched, metrics_switched = train_step(state, toy_batch, rng,
                                                switched)
  np.testing.assert_allclose(metrics['loss_sum'], metrics_switched['loss_sum'],
                             rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-7),
               after.params, after_switched.params)


def test_a_bfloat16_search_accumulates_in_float32_and_moves_its_cache_as_bits(
    toy_model):
  """In bfloat16 every product of a beam search's program asks for a float32
  result (XLA's CPU backend then runs it on its bfloat16 kernels; asked for
  bfloat16 it computes in float32 by itself, slower), and no gather or
  scatter moves bfloat16 (XLA's CPU backend would convert their whole
  operand to float32 and back): the key/value cache moves as uint16."""
  cfg, params, src = toy_model
  cfg = cfg.replace(dtype='bfloat16')
  text = jax.jit(lambda params, src: decoding.beam_decode(
      params, src, cfg, beam_size=2, grow_cache=True)).lower(
          params, src).as_text()
  products = re.findall(r'stablehlo\.dot_general.*', text)
  assert products and all(re.search(r'-> tensor<[0-9x]*xf32>$', product)
                          for product in products), products
  # The operand of every gather and scatter of a [rows, heads, len, d_k]
  # cache, also as [batch, beams, heads, len, d_k] (the embeddings' lookups
  # of one token a row are left as they are).
  operands = re.findall(r'"stablehlo\.(?:gather"\([^\n]*?\}>|scatter"\(.*?'
                        r'\}\)) : \(tensor<([0-9x]+)x(\w+)>', text, re.S)
  moved = {dtype for shape, dtype in operands if shape.count('x') >= 3}
  assert moved == {'ui16'}, operands


def test_sixteen_bit_moves_as_bits_are_the_same_moves():
  keys = jax.random.split(jax.random.key(0), 2)
  rows = jnp.array([2, 0, 5, 2])
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    x = jax.random.normal(keys[0], (6, 5)).astype(dtype)
    new = jax.random.normal(keys[1], (4, 5)).astype(dtype)
    gather = cpu_kernels.as_bits(lambda x, rows: x[rows])
    scatter = cpu_kernels.as_bits(lambda x, new, rows: x.at[rows].set(new))
    got = (jax.jit(gather)(x, rows), jax.jit(scatter)(x, new, rows))
    for moved, plain in zip(got, (x[rows], x.at[rows].set(new))):
      assert moved.dtype == dtype
      np.testing.assert_array_equal(moved.view(np.uint8) if dtype != jnp.float32
                                    else moved, np.asarray(plain).view(np.uint8)
                                    if dtype != jnp.float32 else plain)


def test_bfloat16_products_are_the_float32_product_rounded_once():
  cfg = get_config('toy').replace(dtype='bfloat16')
  keys = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(keys[0], (2, 3, 64)).astype(jnp.bfloat16)
  for switch in (False, True):
    layer = nn.Dense(16, dtype=jnp.bfloat16, dot_general=(
        cpu_kernels.dot_general_for(cfg.replace(cpu_kernels=switch))))
    params = layer.init(keys[1], x)['params']
    y = layer.apply({'params': params}, x)
    assert y.dtype == jnp.bfloat16
    exact = (np.asarray(x, np.float32) @ np.asarray(
        params['kernel'].astype(jnp.bfloat16), np.float32)).astype(
            jnp.bfloat16) + params['bias'].astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np.asarray(exact, np.float32), rtol=1e-2,
                               atol=1e-2)
  # float32 keeps Flax's own product.
  assert cpu_kernels.dot_general_for(get_config('toy')) is None
