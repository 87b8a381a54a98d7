"""Decoding: what we feed in after training to get an output sentence.

The core is model-agnostic (as in T5X): a search takes a function
`tokens_to_logits(tokens, cache) -> (logits, new_cache)` and never looks
inside the model. The Transformer entry points below build that function from
params: the encoder runs once, then the decoder runs one token per step with
its key/value cache. Everything is a jax.lax loop, so the whole search runs on
the device and can be jitted, vmapped or sharded by the caller.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp

from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.masks import padding_mask
from flaxformer_mini.model import Transformer

TokensToLogits = Callable[[jnp.ndarray, Any], tuple[jnp.ndarray, Any]]


def greedy_search(tokens_to_logits: TokensToLogits, cache, batch_size: int,
                  max_len: int, bos_id: int, eos_id: int, pad_id: int):
  """Picks the most likely next token until eos or max_len.

  Args:
    tokens_to_logits: (int32[batch, 1] last tokens, cache) ->
      (float32[batch, vocab] next-token logits, new cache).
    cache: the decoder state before the first step.
    batch_size: number of sequences.
    max_len: number of output positions.
    bos_id, eos_id, pad_id: the first input token, the token that ends a
      sequence, and the filler after it.

  Returns:
    int32[batch, max_len]: each row is the output tokens, eos included if
    generated, then pad.
  """
  # tokens[:, 0] is bos; step i reads tokens[:, i] and writes tokens[:, i + 1].
  tokens = jnp.full((batch_size, max_len + 1), pad_id, jnp.int32)
  tokens = tokens.at[:, 0].set(bos_id)
  finished = jnp.zeros((batch_size,), bool)

  def not_done(state):
    step, _, _, finished = state
    return (step < max_len) & ~jnp.all(finished)

  def one_token(state):
    step, tokens, cache, finished = state
    last = jax.lax.dynamic_slice_in_dim(tokens, step, 1, axis=1)  # [batch, 1]
    logits, cache = tokens_to_logits(last, cache)  # [batch, vocab]
    next_token = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [batch]
    next_token = jnp.where(finished, pad_id, next_token)
    tokens = jax.lax.dynamic_update_slice(tokens, next_token[:, None],
                                          (0, step + 1))
    return step + 1, tokens, cache, finished | (next_token == eos_id)

  _, tokens, _, _ = jax.lax.while_loop(
      not_done, one_token, (jnp.asarray(0), tokens, cache, finished))
  return tokens[:, 1:]


def init_cache(config: TransformerConfig, encoded, src_mask, max_len: int):
  """An all-zero key/value cache for `max_len` decoder steps.

  encoded: [batch, src_len, d_model] -> a pytree of [batch, heads, max_len,
  d_k] keys and values per decoder layer, plus the position counters.
  """
  model = Transformer(config)
  dummy = jnp.zeros((encoded.shape[0], max_len), jnp.int32)
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.key(0), encoded, src_mask, dummy,
                         decode=True, method=Transformer.decode))['cache']
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def transformer_tokens_to_logits(params, config: TransformerConfig, encoded,
                                 src_mask) -> TokensToLogits:
  """The decoder of Transformer(config) as a one-step function with cache.

  encoded: [batch, src_len, d_model] and src_mask: bool[batch, 1, 1, src_len]
  are fixed for the whole search (the encoder ran once).
  """
  model = Transformer(config)

  def tokens_to_logits(tokens, cache):
    logits, variables = model.apply(
        {'params': params, 'cache': cache}, encoded, src_mask, tokens,
        decode=True, mutable=['cache'], method=Transformer.decode)
    return logits[:, -1], variables['cache']

  return tokens_to_logits


def check_max_len(config: TransformerConfig, max_len: int):
  if not 0 < max_len <= config.max_len:
    raise ValueError(
        f'max_len={max_len}: must lie in [1, config.max_len={config.max_len}] '
        '(the positional-encoding table); raise --max_len to decode longer.')


def greedy_decode(params, src, config: TransformerConfig, max_len: int):
  """Greedy translation of a batch with Transformer(config) and `params`.

  Args:
    params: the model parameters.
    src: int32[batch, src_len], pad-filled source ids.
    config: the model's config (static under jit).
    max_len: output positions (static under jit).

  Returns:
    int32[batch, max_len] output ids: the tokens, eos, then pad.
  """
  check_max_len(config, max_len)
  src_mask = padding_mask(src, config.pad_id)
  encoded = Transformer(config).apply({'params': params}, src, src_mask,
                                      method=Transformer.encode)
  return greedy_search(
      transformer_tokens_to_logits(params, config, encoded, src_mask),
      init_cache(config, encoded, src_mask, max_len), src.shape[0], max_len,
      config.bos_id, config.eos_id, config.pad_id)
