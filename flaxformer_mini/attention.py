"""Figure 2: scaled dot-product attention and multi-head attention.

Three arrows go into every attention block: queries, keys and values. Each
gets its own learned projection, then the model splits d_model into h heads
of size d_k = d_model / h, attends in each head independently, concatenates
the heads and mixes them with the output projection W^O.

Every intermediate is recorded with `sow` in the 'intermediates' collection
(free unless that collection is requested as mutable), which is what the
tensor tour and the attention plots read.
"""

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_mini import cpu_kernels
from flaxformer_mini.cpu_kernels import as_bits
from flaxformer_mini.config import TransformerConfig


def scaled_dot_product_attention(
    query, key, value, mask=None,
    dropout: Callable[[jnp.ndarray], jnp.ndarray] = lambda weights: weights):
  """softmax(Q K^T / sqrt(d_k)) V, with masked keys given exactly zero weight.

  Args:
    query: dtype[batch, heads, q_len, d_k].
    key: dtype[batch, heads, k_len, d_k].
    value: dtype[batch, heads, k_len, d_k].
    mask: bool, broadcastable to [batch, heads, q_len, k_len]; True = attend.
    dropout: applied to the weights before they mix the values.

  Returns:
    (output dtype[batch, heads, q_len, d_k], scores float32[batch, heads,
    q_len, k_len] after masking, weights float32[batch, heads, q_len, k_len]);
    dtype is the operands' (config.dtype in the model).
  """
  d_k = query.shape[-1]
  # Both products accumulate in float32 even when their operands are in a
  # lower precision, and the softmax runs in float32 (asked for a float32
  # result, XLA's CPU backend hands bfloat16 products to its fast kernels).
  scores = cpu_kernels.product('bhqd,bhkd->bhqk', query, key,
                               dtype=jnp.float32) / jnp.sqrt(jnp.float32(d_k))
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  if mask is not None:
    # A row with every key masked would otherwise get uniform weights.
    weights = jnp.where(mask, weights, 0.0)
  output = cpu_kernels.product('bhqk,bhkd->bhqd',
                               dropout(weights).astype(value.dtype), value)
  return output, scores, weights


def grouped_attention(query, key, value, mask=None, dropout=lambda w: w):
  """scaled_dot_product_attention where every k consecutive query rows share
  one row of keys and values: a search's beams (or samples) of one sentence
  attending to its encoder output.

  Args:
    query: dtype[batch * k, heads, q_len, d_k].
    key, value: dtype[batch, heads, k_len, d_k] (k = 1: plain attention).
    mask: bool, broadcastable to [batch, heads, 1, k_len] where k > 1 (one
      row per key row, or 1), else to [batch, heads, q_len, k_len].
    dropout: as scaled_dot_product_attention's.

  Returns:
    (output dtype[batch * k, heads, q_len, d_k], scores and weights
    float32[batch, heads, k * q_len, k_len]: row i's queries at rows
    i * k ... of the sentence's block).

  Each query row attends exactly as it would to its own copy of the keys
  (softmax is per query), but a row's keys are read once for its k queries:
  a batched matrix product instead of k matrix-vector products. In a beam
  search step that is most of the cross-attention's memory traffic
  (docs/performance.md, "Cross-attention once per sentence").
  """
  rows, heads, q_len, d_k = query.shape
  batch = key.shape[0]
  if rows == batch:
    return scaled_dot_product_attention(query, key, value, mask, dropout)
  if rows % batch:
    raise ValueError(
        f'{rows} query rows against {batch} rows of keys: the query rows '
        'must be k per key row, consecutive (expand_to_beams order).')
  k = rows // batch
  grouped = query.reshape(batch, k, heads, q_len, d_k).transpose(
      0, 2, 1, 3, 4).reshape(batch, heads, k * q_len, d_k)
  output, scores, weights = scaled_dot_product_attention(
      grouped, key, value, mask, dropout)
  output = output.reshape(batch, heads, k, q_len, d_k).transpose(
      0, 2, 1, 3, 4).reshape(rows, heads, q_len, d_k)
  return output, scores, weights


def split_heads(x, num_heads: int):
  """x: dtype[batch, len, d_model] -> dtype[batch, heads, len, d_k]."""
  batch, length, d_model = x.shape
  return x.reshape(batch, length, num_heads, d_model // num_heads).transpose(
      0, 2, 1, 3)


def merge_heads(x):
  """x: dtype[batch, heads, len, d_k] -> dtype[batch, len, heads * d_k], the concatenation."""
  batch, heads, length, d_k = x.shape
  return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * d_k)


class MultiHeadAttention(nn.Module):
  """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

  W_i^Q of every head is one column block of a single [d_model, d_model]
  matrix W^Q (the same for K and V), so one product projects all heads and
  a reshape splits them (`split_heads`).

  In incremental decoding (`incremental=True`, one new token per call),
  self-attention keeps the keys and values of the tokens seen so far in the
  'cache' collection and attends to all of them. Cross-attention
  (`cross_attention=True`) attends to the encoder output, which is fixed for
  the whole search: its keys and values are projected once into the
  'cross_kv' collection (`decoding.project_cross_kv`) and read from there at
  every step, one row per sentence for all of its beams (`grouped_attention`).
  """
  config: TransformerConfig
  cross_attention: bool = False

  @nn.compact
  def __call__(self, inputs_q, inputs_kv, mask=None, deterministic: bool = True,
               incremental: bool = False, positions=None):
    """Attends from inputs_q to inputs_kv.

    Args:
      inputs_q: dtype[batch, q_len, d_model], where the queries come from.
      inputs_kv: dtype[batch, k_len, d_model], where the keys and values come
        from (the same tensor for self-attention; the encoder output for
        cross-attention). In incremental cross-attention its keys and values
        may have one row per k query rows (batch / k: a search's beams of
        one sentence, consecutive), read once for all k.
      mask: bool, broadcastable to [batch, heads, q_len, k_len] (one row per
        row of keys). Ignored by self-attention in incremental decoding,
        where the cache supplies the causal mask.
      deterministic: disables dropout.
      incremental: one step of decoding: self-attention reads and extends
        the key/value cache; cross-attention reads 'cross_kv' where it is
        present and stores its projections there where it is mutable.
      positions: int32[batch, q_len], the queries' positions: where
        self-attention writes the new keys and values in its cache, and
        which cached positions each query may see (incremental only).

    Returns:
      dtype[batch, q_len, d_model] (dtype: config.dtype).
    """
    cfg = self.config
    dense = functools.partial(nn.Dense, cfg.d_model, dtype=cfg.dtype,
                              dot_general=cpu_kernels.dot_general_for(cfg))
    # 1) Project: W^Q, W^K, W^V of all heads at once, then split d_model
    #    into h heads of d_k.
    query = split_heads(dense(name='wq')(inputs_q), cfg.num_heads)
    key, value = self._keys_and_values(inputs_kv, dense, incremental)
    self.sow('intermediates', 'query', query)
    self.sow('intermediates', 'key', key)
    self.sow('intermediates', 'value', value)
    if incremental and not self.cross_attention:
      key, value, mask = self._update_cache(key, value, positions)

    # 2) Scaled dot-product attention in every head at once.
    dropout = nn.Dropout(cfg.attention_dropout_rate)
    heads, scores, weights = grouped_attention(
        query, key, value, mask,
        dropout=lambda w: dropout(w, deterministic=deterministic))
    self.sow('intermediates', 'scores', scores)
    self.sow('intermediates', 'weights', weights)
    self.sow('intermediates', 'heads', heads)

    # 3) Concatenate the heads and mix them with W^O.
    concatenated = merge_heads(heads)
    self.sow('intermediates', 'concatenated', concatenated)
    output = dense(name='wo')(concatenated)
    self.sow('intermediates', 'output', output)
    return output

  def _keys_and_values(self, inputs_kv, dense, incremental: bool):
    """inputs_kv W^K and inputs_kv W^V, split into heads.

    inputs_kv: dtype[batch, k_len, d_model] -> key and value, each
    dtype[batch, heads, k_len, d_k]. A key bias would add q.b to every score
    of a row, which softmax ignores (its gradient is exactly zero), so the
    keys have none. In incremental decoding, cross-attention reads them from
    the 'cross_kv' collection where they are (the encoder output is the same
    at every step), and stores them there where it is mutable.
    """
    reuse = incremental and self.cross_attention
    if reuse and self.has_variable('cross_kv', 'key'):
      return (self.get_variable('cross_kv', 'key'),
              self.get_variable('cross_kv', 'value'))
    heads = self.config.num_heads
    key = split_heads(dense(use_bias=False, name='wk')(inputs_kv), heads)
    value = split_heads(dense(name='wv')(inputs_kv), heads)
    if reuse and self.is_mutable_collection('cross_kv'):
      self.put_variable('cross_kv', 'key', key)
      self.put_variable('cross_kv', 'value', value)
    return key, value

  def _update_cache(self, key, value, positions):
    """Writes the new keys/values at their positions; returns all of them.

    key, value: dtype[batch, heads, new_len, d_k]; positions: int32[batch,
    new_len], consecutive in each row -> the cached key and value
    dtype[batch, heads, cache_len, d_k] and the mask bool[batch, 1, new_len,
    cache_len] that lets each query see the cached positions up to its own.
    """
    is_initialized = self.has_variable('cache', 'cached_key')
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, key.shape,
                               key.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros,
                                 value.shape, value.dtype)
    new_len, cache_len = key.shape[2], cached_key.value.shape[2]
    if not is_initialized:
      # Initialisation sees the full-length dummy target: it only sizes the
      # cache, so attend causally over that dummy input.
      return key, value, jnp.tril(jnp.ones((new_len, new_len), bool))[None,
                                                                       None]
    # Each row writes at its own first position (rows may be at different
    # steps, e.g. sentences that joined a search later).
    write = as_bits(jax.vmap(lambda cache, new, start: (
        jax.lax.dynamic_update_slice(cache, new, (0, start, 0)))))
    cached_key.value = write(cached_key.value, key, positions[:, 0])
    cached_value.value = write(cached_value.value, value, positions[:, 0])
    mask = jnp.arange(cache_len)[None, None, :] <= positions[:, :, None]
    return cached_key.value, cached_value.value, mask[:, None]
