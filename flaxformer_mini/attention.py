"""Figure 2: scaled dot-product attention and multi-head attention.

Three arrows go into every attention block: queries, keys and values. Each
gets its own learned projection, then the model splits d_model into h heads
of size d_k = d_model / h, attends in each head independently, concatenates
the heads and mixes them with the output projection W^O.

Every intermediate is recorded with `sow` in the 'intermediates' collection
(free unless that collection is requested as mutable), which is what the
tensor tour and the attention plots read.
"""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.linear import dense


def scaled_dot_product_attention(
    query, key, value, mask=None,
    dropout: Callable[[jnp.ndarray], jnp.ndarray] = lambda weights: weights):
  """softmax(Q K^T / sqrt(d_k)) V, with masked keys given exactly zero weight.

  Args:
    query: [batch, heads, q_len, d_k].
    key: [batch, heads, k_len, d_k].
    value: [batch, heads, k_len, d_k].
    mask: bool, broadcastable to [batch, heads, q_len, k_len]; True = attend.
    dropout: applied to the weights before they mix the values.

  Returns:
    (output [batch, heads, q_len, d_k], scores [batch, heads, q_len, k_len]
    after masking, weights [batch, heads, q_len, k_len]).
  """
  d_k = query.shape[-1]
  scores = jnp.einsum('bhqd,bhkd->bhqk', query, key) / jnp.sqrt(
      jnp.asarray(d_k, query.dtype))
  # Softmax in float32 even when the matmuls run in a lower precision.
  scores = scores.astype(jnp.float32)
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  if mask is not None:
    # A row with every key masked would otherwise get uniform weights.
    weights = jnp.where(mask, weights, 0.0)
  output = jnp.einsum('bhqk,bhkd->bhqd', dropout(weights).astype(value.dtype),
                      value)
  return output, scores, weights


def attention_shared_by_groups(query, key, value, mask=None,
                               dropout=lambda weights: weights):
  """Scaled dot-product attention where consecutive query rows share keys.

  In beam search the `group` beams of one sentence attend to the same
  encoder output, so its keys and values are kept once per sentence: the
  group's queries are stacked along q_len and attend together, which reads
  each sentence's keys once instead of once per beam.

  Args:
    query: [batch * group, heads, q_len, d_k], the rows of one group
      consecutive.
    key, value: [batch, heads, k_len, d_k].
    mask: bool, broadcastable to [batch, heads, 1, k_len].
    dropout: as in scaled_dot_product_attention.

  Returns:
    As scaled_dot_product_attention, for every query row: output
    [batch * group, heads, q_len, d_k], scores and weights
    [batch * group, heads, q_len, k_len].
  """
  rows, heads, q_len, _ = query.shape
  batch = key.shape[0]
  group = rows // batch

  def per_group(x):  # [batch * group, heads, q_len, n] -> [batch, heads, group * q_len, n]
    x = x.reshape(batch, group, heads, q_len, x.shape[-1])
    return x.transpose(0, 2, 1, 3, 4).reshape(batch, heads, group * q_len, -1)

  def per_row(x):  # the inverse
    x = x.reshape(batch, heads, group, q_len, x.shape[-1])
    return x.transpose(0, 2, 1, 3, 4).reshape(rows, heads, q_len, -1)

  output, scores, weights = scaled_dot_product_attention(
      per_group(query), key, value, mask, dropout)
  return per_row(output), per_row(scores), per_row(weights)


def fused_attention(query, key, value, key_lengths, causal: bool,
                    implementation: str):
  """softmax(Q K^T / sqrt(d_k)) V as one call of jax.nn.dot_product_attention.

  What scaled_dot_product_attention computes for this model's masks, with
  the masks given as fused kernels take them: how many keys of each item are
  real (its padding comes after them), and whether query i sees only keys
  j <= i. No scores or weights are returned: on a GPU, 'cudnn' (flash
  attention) never writes them to memory.

  Args:
    query: [batch, q_len, heads, d_k] (length before heads: the kernels'
      layout, so no transpose is needed around them).
    key, value: [batch, k_len, heads, d_k].
    key_lengths: int32[batch], real keys per item; None: all keys are real.
    causal: query i attends to keys j <= i only.
    implementation: 'xla' or 'cudnn'.

  Returns:
    [batch, q_len, heads, d_k].
  """
  q_len = query.shape[1]
  if implementation == 'cudnn':
    query, key, value, key_lengths = cudnn_operands(query, key, value,
                                                    key_lengths)
  output = jax.nn.dot_product_attention(
      query, key, value, is_causal=causal,
      key_value_seq_lengths=key_lengths, implementation=implementation)
  return output[:, :q_len]


def cudnn_operands(query, key, value, key_lengths):
  """The same attention in a form JAX's cuDNN path takes in training.

  It refuses odd query or key lengths (its check counts a bias even where
  none is given), so an odd length gets one more position: the added key is
  padding, left out by the key counts, and the added query's output is cut
  off by the caller. And a row of all pad (batches are topped up with them)
  keeps one key: with none its softmax has nothing to normalise, and a NaN
  from it would reach the weights' gradients though no loss reads the row.

  Shapes as fused_attention's, lengths rounded up to even; key_lengths ->
  int32[batch], each at least 1 (made explicit where None).
  """
  to_even = lambda x: jnp.pad(x, ((0, 0), (0, x.shape[1] % 2), (0, 0), (0, 0)))
  if key_lengths is None:
    key_lengths = jnp.full((key.shape[0],), key.shape[1], jnp.int32)
  return (to_even(query), to_even(key), to_even(value),
          jnp.maximum(key_lengths, 1))


def check_backend(config: TransformerConfig) -> None:
  """A clear error, before anything compiles, where config's attention cannot run."""
  backend = jax.default_backend()
  if config.attention_implementation == 'cudnn' and backend != 'gpu':
    raise ValueError(
        '--attention_implementation=cudnn needs an NVIDIA GPU, and this '
        f'process runs on {backend}; use --attention_implementation=xla (the '
        'same function on any backend) or explicit.')


def key_lengths(mask, batch: int):
  """Real keys per item of a padding (or padding AND causal) mask.

  mask: bool, broadcastable to [batch, 1, q_len, k_len], padding at the end
  of each item -> int32[batch]; None -> None. The last query row is the
  padding row alone, since a causal mask lets the last query see every key.
  """
  if mask is None:
    return None
  lengths = jnp.sum(mask[:, 0, -1, :], axis=-1, dtype=jnp.int32)
  return jnp.broadcast_to(lengths, (batch,))


def split_heads(x, num_heads: int):
  """[batch, len, d_model] -> [batch, heads, len, d_k]."""
  batch, length, d_model = x.shape
  return x.reshape(batch, length, num_heads, d_model // num_heads).transpose(
      0, 2, 1, 3)


def merge_heads(x):
  """[batch, heads, len, d_k] -> [batch, len, heads * d_k] (the concatenation)."""
  batch, heads, length, d_k = x.shape
  return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * d_k)


class MultiHeadAttention(nn.Module):
  """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O.

  In decode mode self-attention keeps the keys and values of the tokens seen
  so far in the 'cache' collection, so each call processes only the new
  token(s) and attends to everything before them. Encoder-decoder attention
  (`from_memory=True`) attends to the encoder output, which is fixed for the
  whole search: in decode mode it reads its keys and values from the 'memory'
  collection when they were projected once beforehand (see
  `decoding.project_memory`), instead of projecting the encoder output again
  at every step. Those keys and values may have one row per sentence while
  the queries have one per beam (`beams` consecutive rows per sentence): the
  beams then share them (`attention_shared_by_groups`).

  With `config.attention_implementation` 'xla' or 'cudnn', training and
  evaluation attend through `fused_attention` instead; decoding, and any call
  that collects 'intermediates', keep the explicit path above. The fused
  kernels take masks as key counts and a causal flag (`causal`), so they need
  this model's masks: padding at the end of each item, and causal where
  `causal` says so.
  """
  config: TransformerConfig
  from_memory: bool = False
  causal: bool = False  # the decoder's self-attention: its mask is causal

  @nn.compact
  def __call__(self, inputs_q, inputs_kv, mask=None, deterministic: bool = True,
               decode: bool = False):
    """Attends from inputs_q to inputs_kv.

    Args:
      inputs_q: [batch, q_len, d_model], where the queries come from.
      inputs_kv: [batch, k_len, d_model], where the keys and values come from
        (the same tensor for self-attention; the encoder output for the
        decoder's second block).
      mask: bool, broadcastable to [batch, heads, q_len, k_len]. Ignored by
        self-attention in decode mode, where the cache supplies the causal mask.
      deterministic: disables dropout.
      decode: self-attention uses and updates the key/value cache;
        attention from memory uses the 'memory' collection where present and
        stores its projections there where it is mutable.

    Returns:
      [batch, q_len, d_model].
    """
    cfg = self.config
    # W^Q, W^K, W^V of all heads at once: [d_model, h * d_k] each. A key
    # bias would add q.b to every score of a row, which softmax ignores: its
    # gradient is exactly zero, and Adam would only turn rounding noise in
    # it into updates. So the keys have none.
    projection = lambda name, bias=True: dense(cfg.d_model, cfg, name, bias)
    if (cfg.attention_implementation != 'explicit' and not decode and
        not self.is_mutable_collection('intermediates')):
      as_heads = lambda x: x.reshape(x.shape[:2] + (cfg.num_heads, cfg.d_k))
      heads = fused_attention(
          as_heads(projection('wq')(inputs_q)),
          as_heads(projection('wk', bias=False)(inputs_kv)),
          as_heads(projection('wv')(inputs_kv)),
          key_lengths(mask, inputs_kv.shape[0]), self.causal,
          cfg.attention_implementation)
      return dense(cfg.d_model, cfg, 'wo')(
          heads.reshape(inputs_q.shape[:2] + (cfg.d_model,)))
    query = split_heads(projection('wq')(inputs_q), cfg.num_heads)
    if decode and self.from_memory and self.has_variable('memory', 'key'):
      key = self.get_variable('memory', 'key')
      value = self.get_variable('memory', 'value')
    else:
      key = split_heads(projection('wk', bias=False)(inputs_kv), cfg.num_heads)
      value = split_heads(projection('wv')(inputs_kv), cfg.num_heads)
      if decode and self.from_memory and self.is_mutable_collection('memory'):
        self.put_variable('memory', 'key', key)
        self.put_variable('memory', 'value', value)
    self.sow('intermediates', 'query', query)
    self.sow('intermediates', 'key', key)
    self.sow('intermediates', 'value', value)

    if decode and not self.from_memory:
      key, value, mask = self._update_cache(key, value)

    dropout_layer = nn.Dropout(cfg.attention_dropout_rate)
    # Beam search keeps the encoder output once per sentence, not per beam.
    attend = (attention_shared_by_groups
              if query.shape[0] != key.shape[0] else
              scaled_dot_product_attention)
    heads, scores, weights = attend(
        query, key, value, mask,
        dropout=lambda w: dropout_layer(w, deterministic=deterministic))
    self.sow('intermediates', 'scores', scores)
    self.sow('intermediates', 'weights', weights)
    self.sow('intermediates', 'heads', heads)
    concatenated = merge_heads(heads)
    self.sow('intermediates', 'concatenated', concatenated)
    output = dense(cfg.d_model, cfg, 'wo')(concatenated)
    self.sow('intermediates', 'output', output)
    return output

  def _update_cache(self, key, value):
    """Writes the new keys/values at the cache index; returns all of them.

    key, value: [batch, heads, new_len, d_k] -> cached key and value
    [batch, heads, cache_len, d_k] and the mask bool[1, 1, new_len, cache_len]
    that lets query i see the cached positions up to its own.
    """
    is_initialized = self.has_variable('cache', 'cached_key')
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, key.shape,
                               key.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros,
                                 value.shape, value.dtype)
    cache_index = self.variable('cache', 'cache_index',
                                lambda: jnp.zeros((), jnp.int32))
    new_len, cache_len = key.shape[2], cached_key.value.shape[2]
    if not is_initialized:
      # Initialisation sees the full-length dummy target: it only sizes the
      # cache, so attend causally over that dummy input.
      return key, value, jnp.tril(jnp.ones((new_len, new_len), bool))[None,
                                                                       None]
    index = cache_index.value
    start = (0, 0, index, 0)
    cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, key,
                                                    start)
    cached_value.value = jax.lax.dynamic_update_slice(cached_value.value,
                                                      value, start)
    cache_index.value = index + new_len
    query_positions = index + jnp.arange(new_len)
    mask = jnp.arange(cache_len)[None, :] <= query_positions[:, None]
    return cached_key.value, cached_value.value, mask[None, None]
