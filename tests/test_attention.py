import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_mini.attention import (MultiHeadAttention,
                                       attention_shared_by_groups,
                                       check_backend, key_lengths,
                                       cudnn_operands, merge_heads,
                                       scaled_dot_product_attention,
                                       split_heads)
from flaxformer_mini.config import get_config
from flaxformer_mini.losses import label_smoothed_kl
from flaxformer_mini.masks import causal_mask, make_batch
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import create_train_state, init_params, train_step


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


def test_groups_sharing_keys_attend_as_with_keys_repeated_per_row():
  # 2 sentences x 3 beams of queries; keys, values and mask per sentence.
  q, _, _ = _random_qkv(batch=6, q_len=2)
  _, k, v = _random_qkv(batch=2)
  mask = jnp.array([True, True, True, False, False])[None, None, None]
  mask = jnp.concatenate([mask, jnp.ones_like(mask)])  # [2, 1, 1, 5]
  shared = attention_shared_by_groups(q, k, v, mask)
  repeat = lambda x: jnp.repeat(x, 3, axis=0)
  repeated = scaled_dot_product_attention(q, repeat(k), repeat(v),
                                          repeat(mask))
  for got, expected in zip(shared, repeated):
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


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
  memory = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model))
  module = MultiHeadAttention(cfg)
  variables = module.init(jax.random.key(2), x, memory)
  out, state = module.apply(variables, x, memory, mutable=['intermediates'])
  inter = state['intermediates']
  p = variables['params']
  project = lambda inp, name: inp @ p[name]['kernel'] + p[name].get('bias', 0)
  assert 'bias' not in p['wk']  # softmax ignores a key bias
  heads = []
  for h in range(cfg.num_heads):
    cols = slice(h * cfg.d_k, (h + 1) * cfg.d_k)
    q = project(x, 'wq')[..., cols]
    k = project(memory, 'wk')[..., cols]
    v = project(memory, 'wv')[..., cols]
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


def _padded_batch(cfg):
  """Four pairs padded at the end at different lengths, or not at all.

  Sources: 5, 9, 9 and 1 real tokens; targets in: 7, 5, 3 and 7.
  """
  rng = np.random.default_rng(0)
  src = rng.integers(3, cfg.src_vocab_size, (4, 9))
  src[0, 5:] = cfg.pad_id
  src[3, 1:] = cfg.pad_id
  tgt = rng.integers(3, cfg.tgt_vocab_size, (4, 8))
  tgt[:, 0] = cfg.bos_id
  tgt[1, 4], tgt[1, 5:] = cfg.eos_id, cfg.pad_id
  tgt[2, 2], tgt[2, 3:] = cfg.eos_id, cfg.pad_id
  return make_batch(src, tgt, cfg)


def test_key_lengths_count_the_real_keys_of_padding_and_target_masks():
  cfg = get_config('toy')
  batch = _padded_batch(cfg)
  np.testing.assert_array_equal(key_lengths(batch.src_mask, 4), [5, 9, 9, 1])
  np.testing.assert_array_equal(key_lengths(batch.tgt_mask, 4), [7, 5, 3, 7])
  np.testing.assert_array_equal(key_lengths(causal_mask(3), 2), [3, 3])
  assert key_lengths(None, 4) is None


def test_fused_attention_is_the_explicit_path_on_every_real_position(
    monkeypatch):
  """The same logits and gradients, through jax.nn.dot_product_attention.

  'xla' takes the same arguments (key counts, the causal flag) that 'cudnn'
  takes on a GPU. Pad positions may differ (their queries see pad keys in
  the decoder); nothing reads them, so the gradients are the same.
  """
  cfg = get_config('toy').replace(src_vocab_size=20, tgt_vocab_size=20,
                                  dropout_rate=0.0)
  batch = _padded_batch(cfg)
  params = init_params(cfg, jax.random.key(0))
  real = np.asarray(batch.tgt_out != cfg.pad_id)

  def loss_and_logits(params, implementation):
    logits = Transformer(cfg.replace(
        attention_implementation=implementation)).apply(
            {'params': params}, batch.src, batch.tgt_in, batch.src_mask,
            batch.tgt_mask)
    loss_sum, _ = label_smoothed_kl(logits, batch.tgt_out, 0.1, cfg.pad_id)
    return loss_sum, logits

  (explicit_loss, explicit), explicit_grads = jax.value_and_grad(
      loss_and_logits, has_aux=True)(params, 'explicit')
  calls = []
  fused_kernel = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, 'dot_product_attention',
                      lambda *a, **k: calls.append(k) or fused_kernel(*a, **k))
  (fused_loss, fused), fused_grads = jax.value_and_grad(
      loss_and_logits, has_aux=True)(params, 'xla')
  # Every block went through the fused call: 2 encoder self-attentions, 2
  # causal decoder self-attentions and 2 encoder-decoder attentions.
  assert [k['is_causal'] for k in calls] == [False] * 2 + [True, False] * 2
  np.testing.assert_allclose(np.asarray(fused)[real],
                             np.asarray(explicit)[real], atol=1e-5)
  np.testing.assert_allclose(fused_loss, explicit_loss, rtol=1e-6)
  for got, expected in zip(jax.tree.leaves(fused_grads),
                           jax.tree.leaves(explicit_grads)):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_collecting_intermediates_takes_the_explicit_path():
  # The tour and the plots read the attention weights, which fused kernels
  # never form.
  cfg = get_config('toy').replace(attention_implementation='xla')
  batch = _padded_batch(cfg)
  model = Transformer(cfg)
  params = init_params(cfg, jax.random.key(0))
  _, state = model.apply({'params': params}, batch.src, batch.tgt_in,
                         batch.src_mask, batch.tgt_mask,
                         mutable=['intermediates'])
  weights = state['intermediates']['decoder']['layer_0']['self_attention'][
      'weights'][0]
  assert weights.shape == (4, cfg.num_heads, 7, 7)
  assert np.all(np.asarray(weights)[..., 0, 1:] == 0.0)  # causal


@pytest.mark.skipif(jax.default_backend() == 'gpu',
                    reason='cudnn attention runs on a GPU')
def test_cudnn_attention_elsewhere_is_refused_before_compiling():
  cfg = get_config('toy').replace(attention_implementation='cudnn',
                                  dtype='bfloat16')
  with pytest.raises(ValueError, match='needs an NVIDIA GPU.*xla'):
    check_backend(cfg)
  check_backend(cfg.replace(attention_implementation='xla'))


@pytest.mark.parametrize('q_len, k_len, causal, lengths', [
    (5, 7, False, None), (5, 7, False, [3, 0]), (5, 5, True, [5, 2])])
def test_cudnn_operands_change_no_real_output(q_len, k_len, causal, lengths):
  # What cuDNN is given (odd lengths made even, no row without keys), run by
  # XLA: the same outputs wherever a row has a real key.
  q, k, v = (x.transpose(0, 2, 1, 3)
             for x in _random_qkv(q_len=q_len, k_len=k_len))
  key_lengths = None if lengths is None else jnp.array(lengths, jnp.int32)
  operands = cudnn_operands(q, k, v, key_lengths)
  even = k_len + k_len % 2
  assert [x.shape[1] for x in operands[:3]] == [q_len + 1, even, even]
  assert np.all(np.asarray(operands[3]) >= 1)
  attend = lambda q, k, v, n: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, key_value_seq_lengths=n,
      implementation='xla')
  got = np.asarray(attend(*operands)[:, :q_len])
  expected = np.asarray(attend(q, k, v, key_lengths))
  rows_with_keys = [n != 0 for n in (lengths or [k_len] * 2)]
  np.testing.assert_allclose(got[rows_with_keys], expected[rows_with_keys],
                             rtol=1e-6, atol=1e-6)
  assert np.all(np.isfinite(got))


def test_cudnn_attention_lowers_every_block_to_the_fused_kernel():
  """The training step lowered for a GPU, on any host where cuDNN is installed.

  Forward and backward, every attention block is one call of cuDNN's flash
  attention, the padding given as key counts, and causal as well in the
  decoder's self-attention.
  """
  cfg = get_config('toy').replace(d_model=32, num_heads=4, dtype='bfloat16',
                                  attention_implementation='cudnn')
  state = create_train_state(cfg, jax.random.key(0))
  step = jax.jit(functools.partial(train_step, config=cfg))
  try:
    text = step.trace(state, _padded_batch(cfg), jax.random.key(1)).lower(
        lowering_platforms=('cuda',)).as_text()
  except RuntimeError as e:
    if 'cuDNN is not detected' not in str(e):
      raise
    pytest.skip('cuDNN is not installed (pip install "jax[cuda12]"), so the '
                'step cannot be lowered for a GPU here.')
  kernels = collections.Counter(re.findall(r'__cudnn\$fmhaSoftmax\w*', text))
  assert kernels == {'__cudnn$fmhaSoftmax': 6,
                     '__cudnn$fmhaSoftmaxBackward': 6}
  masks = collections.Counter(re.findall(r'mask_type[^A-Z]*([A-Z_]+)', text))
  assert masks == {'PADDING': 8, 'PADDING_CAUSAL': 4}
