import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini.config import get_config
from flaxformer_mini.embeddings import TokenEmbedding, sinusoidal_positions


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


def test_the_model_logits_use_the_tied_table():
  cfg = get_config('toy')
  embedding = TokenEmbedding(cfg.src_vocab_size, cfg)
  x = jax.random.normal(jax.random.key(1), (2, 3, cfg.d_model))
  params = embedding.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  table = params['params']['embed']['embedding']
  np.testing.assert_allclose(
      embedding.apply(params, x, method=TokenEmbedding.attend), x @ table.T,
      rtol=1e-6)
