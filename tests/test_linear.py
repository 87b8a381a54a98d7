import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.test_util  # pylint: disable=unused-import
import numpy as np
import pytest

from flaxformer_mini import linear
from flaxformer_mini.config import get_config
from flaxformer_mini.masks import make_batch
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import init_params


def test_dense_is_x_times_kernel_plus_bias_gradients_included():
  cfg = get_config('toy')
  layer = linear.dense(7, cfg)
  x = jax.random.normal(jax.random.key(0), (2, 3, 5))
  params = layer.init(jax.random.key(1), x)['params']
  kernel, bias = params['kernel'], params['bias']
  assert kernel.shape == (5, 7) and bias.shape == (7,)
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


def test_on_cpu_the_kernel_gradient_multiplies_a_materialised_x_transposed():
  # Autodiff's product contracted over the tokens is slower on the CPU; the
  # barrier keeps XLA from folding the transpose back into it. Other
  # platforms keep autodiff's product.
  x = jnp.ones((6, 5))
  kernel_gradient = jax.grad(lambda kernel: jnp.sum(
      linear.dot_general(x, kernel, (((1,), (0,)), ((), ())))))
  for platform, copied in (('cpu', True), ('cuda', False)):
    text = jax.jit(kernel_gradient).trace(jnp.ones((5, 7))).lower(
        lowering_platforms=(platform,)).as_text()
    barriers = re.findall(
        r'(%\S+) = stablehlo\.optimization_barrier %\S+ : tensor<5x6xf32>',
        text)
    assert len(barriers) == copied
    if copied:
      assert re.search(rf'stablehlo\.dot_general {barriers[0]}, ', text)


def test_every_learned_linear_map_of_the_model_is_a_linear_dense():
  for untied in (False, True):
    cfg = get_config('toy').replace(tie_output_embedding=not untied)
    params = init_params(cfg, jax.random.key(0))
    kernels = [path for path, _ in jax.tree_util.tree_leaves_with_path(params)
               if path[-1].key == 'kernel']
    ids = np.array([[1, 3, 4, 2], [1, 5, 2, 0]])
    batch = make_batch(ids[:, 1:], ids, cfg)
    products = []

    def record(call, args, kwargs, context):
      if isinstance(context.module, nn.Dense):
        products.append(context.module.dot_general)
      return call(*args, **kwargs)

    with nn.intercept_methods(record):
      Transformer(cfg).apply({'params': params}, batch.src, batch.tgt_in,
                             batch.src_mask, batch.tgt_mask)
    assert len(products) == len(kernels) > 0, (len(products), len(kernels))
    assert all(p is linear.dot_general for p in products)


def test_dense_refuses_a_product_it_does_not_compute():
  dense_product = (((1,), (0,)), ((), ()))
  for x, kernel, dims, kwargs, named in (
      (jnp.ones((3, 5)), jnp.ones((3, 7)), (((0,), (0,)), ((), ())), {},
       'nn.Dense'),
      (jnp.ones((3, 5)), jnp.ones((5, 7)), dense_product,
       {'preferred_element_type': jnp.float16}, 'config.dtype')):
    with pytest.raises(ValueError, match=re.escape(named)):
      linear.dot_general(x, kernel, dims, **kwargs)
