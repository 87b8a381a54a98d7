import jax
import jax.numpy as jnp
import numpy as np

import pytest

from flaxformer_mini.attention import (MultiHeadAttention, grouped_attention,
                                       merge_heads,
                                       scaled_dot_product_attention,
                                       split_heads)
from flaxformer_mini.config import get_config


def _random_qkv(batch=2, heads=3, q_len=4, k_len=5, d_k=6):
  keys = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(keys[0], (batch, heads, q_len, d_k)),
          jax.random.normal(keys[1], (batch, heads, k_len, d_k)),
          jax.random.normal(keys[2], (batch, heads, k_len, d_k)))


def test_weights_are_probability_rows_and_exactly_zero_on_masked_keys():
  q, k, v = _random_qkv()
  mask = jax.random.bernoulli(jax.random.key(1), 0.5, (2, 1, 4, 5))
  mask = mask.at[..., 0].set(True)  # every query sees at least one key
  out, _, weights = scaled_dot_product_attention(q, k, v, mask)
  assert out.shape == (2, 3, 4, 6)
  assert weights.shape == (2, 3, 4, 5)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
  full_mask = np.broadcast_to(np.asarray(mask), weights.shape)
  assert np.all(np.asarray(weights)[~full_mask] == 0.0)
  assert np.all(np.asarray(weights) >= 0.0)


def test_matches_the_formula():
  q, k, v = _random_qkv()
  out, _, _ = scaled_dot_product_attention(q, k, v)
  expected = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(6), -1) @ v
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_a_fully_masked_row_gets_zero_weights_not_nans():
  q, k, v = _random_qkv(q_len=1)
  out, _, weights = scaled_dot_product_attention(
      q, k, v, jnp.zeros((1, 1, 1, 5), bool))
  assert np.all(np.asarray(weights) == 0.0)
  assert np.all(np.isfinite(out))


def test_grouped_rows_attend_as_each_would_to_its_own_copy_of_the_keys():
  # 2 sentences x 3 beams: each beam's query attends to its sentence's keys,
  # read once for the three; repeating the keys per beam is the reference.
  q, _, _ = _random_qkv(batch=6, q_len=1)
  _, k, v = _random_qkv(batch=2, k_len=5)
  k, v = k * 2.0, v - 1.0  # not the queries' draws
  mask = jnp.array([[True] * 5, [True, True, False, False, False]])[
      :, None, None, :]
  out, scores, weights = grouped_attention(q, k, v, mask)
  repeat = lambda x: jnp.repeat(x, 3, axis=0)
  expected, _, expected_weights = scaled_dot_product_attention(
      q, repeat(k), repeat(v), repeat(mask))
  assert out.shape == (6, 3, 1, 6)
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
  # The second sentence's beams (rows 3-5) put no weight on its padding.
  assert weights.shape == scores.shape == (2, 3, 3, 5)
  np.testing.assert_allclose(weights[1].transpose(1, 0, 2),
                             expected_weights[3:, :, 0], rtol=1e-6)
  assert np.all(np.asarray(weights[1, :, :, 2:]) == 0.0)


def test_grouped_attention_refuses_rows_that_are_not_k_per_key_row():
  q, _, _ = _random_qkv(batch=5, q_len=1)
  _, k, v = _random_qkv(batch=2)
  with pytest.raises(ValueError) as error:
    grouped_attention(q, k, v)
  assert str(error.value) == (
      '5 query rows against 2 rows of keys: the query rows must be k per key '
      'row, consecutive (expand_to_beams order).')


def test_split_and_merge_heads_are_inverses():
  x = jnp.arange(2 * 3 * 8, dtype=jnp.float32).reshape(2, 3, 8)
  heads = split_heads(x, 2)
  assert heads.shape == (2, 2, 3, 4)
  # Head h holds dimensions [h * d_k, (h + 1) * d_k) of every position.
  np.testing.assert_array_equal(heads[:, 1], x[..., 4:])
  np.testing.assert_array_equal(merge_heads(heads), x)


def test_multi_head_attention_equals_per_head_attention_then_concat_and_wo():
  cfg = get_config('toy')
  x = jax.random.normal(jax.random.key(0), (2, 3, cfg.d_model))
  encoded = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model))
  module = MultiHeadAttention(cfg)
  variables = module.init(jax.random.key(2), x, encoded)
  out, state = module.apply(variables, x, encoded, mutable=['intermediates'])
  inter = state['intermediates']
  p = variables['params']
  project = lambda inp, name: inp @ p[name]['kernel'] + p[name].get('bias', 0)
  assert 'bias' not in p['wk']  # softmax ignores a key bias
  heads = []
  for h in range(cfg.num_heads):
    cols = slice(h * cfg.d_k, (h + 1) * cfg.d_k)
    q = project(x, 'wq')[..., cols]
    k = project(encoded, 'wk')[..., cols]
    v = project(encoded, 'wv')[..., cols]
    np.testing.assert_allclose(inter['query'][0][:, h], q, rtol=1e-5)
    weights = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(cfg.d_k))
    heads.append(weights @ v)
  concatenated = jnp.concatenate(heads, axis=-1)
  # The first d_k numbers of each position are head 0's output there.
  np.testing.assert_allclose(inter['concatenated'][0][..., :cfg.d_k],
                             inter['heads'][0][:, 0], rtol=1e-6)
  np.testing.assert_allclose(inter['concatenated'][0], concatenated,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out, project(concatenated, 'wo'), rtol=1e-5,
                             atol=1e-6)
