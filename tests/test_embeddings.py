import re

import jax
import jax.numpy as jnp
import jax.test_util  # pylint: disable=unused-import
import numpy as np

from flaxformer_mini.config import get_config
from flaxformer_mini.embeddings import (FEW_ROWS, TokenEmbedding,
                                        sinusoidal_positions, tied_logits)


def test_sinusoids_interleave_sin_on_even_and_cos_on_odd_dimensions():
  d_model = 6
  table = sinusoidal_positions(5, d_model)
  for pos in range(5):
    for i in range(d_model // 2):
      angle = pos / 10000 ** (2 * i / d_model)
      np.testing.assert_allclose(table[pos, 2 * i], np.sin(angle), atol=1e-6)
      np.testing.assert_allclose(table[pos, 2 * i + 1], np.cos(angle),
                                 atol=1e-6)


def test_odd_d_model_keeps_the_table_shape():
  assert sinusoidal_positions(4, 5).shape == (4, 5)


def test_embeddings_are_scaled_by_sqrt_d_model():
  cfg = get_config('toy')
  module = TokenEmbedding(cfg.src_vocab_size, cfg)
  ids = np.array([[3, 4]])
  variables = module.init(jax.random.key(0), ids)
  table = variables['params']['embed']['embedding']
  np.testing.assert_allclose(module.apply(variables, ids),
                             table[ids] * np.sqrt(cfg.d_model), rtol=1e-6)


def test_tied_logits_is_x_times_the_table_transposed_gradient_included():
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (2, 3, 8))
  table = jax.random.normal(keys[1], (11, 8))
  weights = jax.random.normal(keys[2], (2, 3, 11))
  np.testing.assert_allclose(tied_logits(x, table), x @ table.T, rtol=1e-6)

  def loss(project):
    return lambda x, table: jnp.sum(jnp.tanh(project(x, table)) * weights)

  ours = jax.grad(loss(tied_logits), argnums=(0, 1))(x, table)
  autodiff = jax.grad(loss(lambda x, t: x @ t.T), argnums=(0, 1))(x, table)
  for a, b in zip(ours, autodiff):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # And against finite differences, not only against autodiff.
  jax.test_util.check_grads(tied_logits, (x, table), order=1, modes=['rev'])


def _lowered(fn, *args, platform: str) -> str:
  """fn's StableHLO as lowered for `platform` (no such device needed)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_tied_logits_of_a_few_rows_read_the_table_as_left_operand_on_cpu():
  # A decoding step's rows, on the CPU: table @ x^T behind a barrier, so that
  # XLA cannot turn it back into x @ table.T (slower there); a training
  # batch's many rows, or another platform: x @ table.T. The same logits.
  table = jax.random.normal(jax.random.key(1), (11, 8))
  for rows, platform, table_first in ((FEW_ROWS, 'cpu', True),
                                      (FEW_ROWS + 1, 'cpu', False),
                                      (FEW_ROWS, 'cuda', False)):
    x = jax.random.normal(jax.random.key(0), (1, rows, 8))
    np.testing.assert_allclose(tied_logits(x, table), x @ table.T, rtol=1e-5,
                               atol=1e-6)
    text = _lowered(tied_logits, x, table, platform=platform)
    left_operands = re.findall(r'stablehlo\.dot_general .*: \((tensor<[^>]*>)',
                               text)
    assert left_operands == (['tensor<11x8xf32>'] if table_first else
                             [f'tensor<1x{rows}x8xf32>']), left_operands
    assert ('optimization_barrier' in text) == table_first


def test_the_model_logits_use_the_tied_table():
  cfg = get_config('toy')
  embedding = TokenEmbedding(cfg.src_vocab_size, cfg)
  x = jax.random.normal(jax.random.key(1), (2, 3, cfg.d_model))
  params = embedding.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  table = params['params']['embed']['embedding']
  np.testing.assert_allclose(
      embedding.apply(params, x, method=TokenEmbedding.attend), x @ table.T,
      rtol=1e-6)
