"""Decoding: what we feed in after training to get an output sentence.

The encoder runs once over the source; the cross-attention keys and values of
its output are projected once; then the decoder runs one token at a time,
reading and extending its key/value cache, inside the model-agnostic searches
of `search.py`: `greedy_decode`, `sample_decode` and `beam_decode` are those
searches with Transformer(config). They are plain traceable functions, so
other JAX code calls them under jax.jit, vmap or a mesh. `source_context`
runs the encoder and `context_tokens_to_logits` steps the decoder on what it
gave, for a search in several calls; `slot_cache` and
`slot_tokens_to_logits` give `search.py`'s slots (continuous batching) the
Transformer. Translating many sentences on the host (batches by length,
stages or slots, compiled programs kept per shape) is `translation.py`.
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini.config import DEFAULT_STOPPING, TransformerConfig
from flaxformer_mini.masks import padding_mask
from flaxformer_mini.model import Transformer
from flaxformer_mini.search import (BeamSearchResult, BeamState,
                                    CacheWindows, TokensToLogits, beam_search,
                                    check_sizes, doubling_windows,
                                    greedy_search,
                                    keys_per_row, sample_search)


def init_cache(config: TransformerConfig, batch_size: int, max_len: int):
  """The decoder's empty key/value cache for `max_len` steps of `batch_size` rows.

  -> a pytree of zeros: per decoder layer cached_key and cached_value
  dtype[batch, heads, max_len, d_k] (dtype: config.dtype), and the
  decoder's position int32[batch], each row's tokens fed so far.
  """
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                      _cache_shapes(config, batch_size, max_len))


@functools.lru_cache(maxsize=64)
def _cache_shapes(config: TransformerConfig, batch_size: int, max_len: int):
  """init_cache's leaves as jax.ShapeDtypeStructs, from the decoder's own
  initialisation. Kept per shape: that initialisation traces the whole
  decoder (a third of a second for the Multi30k model), and a search's
  program asks for it at every stage it traces."""
  def initialised(encoded, mask, tokens):
    return Transformer(config).init(jax.random.key(0), encoded, mask, tokens,
                                    incremental=True,
                                    method=Transformer.decode)['cache']
  return jax.eval_shape(
      initialised,
      jax.ShapeDtypeStruct((batch_size, 1, config.d_model), config.dtype),
      jax.ShapeDtypeStruct((batch_size, 1, 1, 1), bool),
      jax.ShapeDtypeStruct((batch_size, max_len), jnp.int32))


def _is_self_attention_cache(path) -> bool:
  """A cache leaf with a position axis (axis 2): a layer's cached keys or values."""
  return getattr(path[-1], 'key', None) in ('cached_key', 'cached_value')


def _take_positions(cache, length: int):
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: (leaf[:, :, :length]
                          if _is_self_attention_cache(path) else leaf), cache)


def _put_positions(cache, window):
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf, new: (
          jax.lax.dynamic_update_slice_in_dim(leaf, new, 0, axis=2)
          if _is_self_attention_cache(path) else new), cache, window)


def cache_windows(max_len: int) -> CacheWindows:
  """The decoder's key/value cache grown by beam search in windows of 24,
  48, ... positions (`search.doubling_windows`, `search.CacheWindows`).

  Reordering the cache with the beams and attending over it cost a step
  as much as the vocabulary's softmax and top-k at max_len positions
  (docs/performance.md, "A cache that grows"); a window of the positions
  written so far cuts both.
  """
  return CacheWindows(lengths=doubling_windows(max_len), take=_take_positions,
                      put=_put_positions)


def project_cross_kv(params, config: TransformerConfig, encoded, src_mask):
  """Every decoder layer's cross-attention keys and values of `encoded`.

  The encoder output is fixed for the whole search, so W^K and W^V are
  applied to it once here, not at every step. encoded: dtype[rows, src_len,
  d_model]; src_mask: bool[rows, 1, 1, src_len] -> the 'cross_kv'
  collection: per decoder layer key and value dtype[rows, heads, src_len,
  d_k].
  """
  first = jnp.full((encoded.shape[0], 1), config.bos_id, jnp.int32)
  _, variables = Transformer(config).apply(
      {'params': params}, encoded, src_mask, first, incremental=True,
      mutable=['cache', 'cross_kv'], method=Transformer.decode)
  return variables['cross_kv']


def _saying_vocab_size(tokens_to_logits, config: TransformerConfig):
  """tokens_to_logits with its logits' width, config.tgt_vocab_size, as an
  attribute: the searches check the logits' shape from it instead of
  tracing the model apart for it (`search._check_model`)."""
  tokens_to_logits.vocab_size = config.tgt_vocab_size
  return tokens_to_logits


def source_context(params, src, config: TransformerConfig):
  """What the decoder reads of the sources src at every step but never changes.

  src: int32[batch, src_len] -> {'cross_kv': every decoder layer's
  cross-attention keys and values of the encoder output
  (`project_cross_kv`), 'src_mask': bool[batch, 1, 1, src_len]}, one row per
  sentence. The encoder runs here, once; a search that narrows to some of
  its sentences takes their rows of this instead of encoding them again.
  """
  check_src(src, config)
  src_mask = padding_mask(src, config.pad_id)
  encoded = Transformer(config).apply({'params': params}, src, src_mask,
                                      method=Transformer.encode)
  return {'cross_kv': project_cross_kv(params, config, encoded, src_mask),
          'src_mask': src_mask}


def _decoder_step(params, config: TransformerConfig, tokens, cache, context):
  """One incremental step of the decoder, reading `context`
  (`source_context`) -> (float32[rows, vocab] logits, new cache)."""
  # Cross-attention reads its keys and values from 'cross_kv': the
  # encoder output itself is never read, only its shape.
  unread = jnp.zeros(tokens.shape + (config.d_model,), config.dtype)
  logits, variables = Transformer(config).apply(
      {'params': params, 'cache': cache, 'cross_kv': context['cross_kv']},
      unread, context['src_mask'], tokens, incremental=True,
      mutable=['cache'], method=Transformer.decode)
  return logits[:, -1], variables['cache']


def context_tokens_to_logits(params, config: TransformerConfig,
                             context) -> TokensToLogits:
  """The decoder of Transformer(config) as a one-step function with a cache,
  reading the sources' `context` (`source_context`, one row per sentence):
  see `transformer_tokens_to_logits`."""
  def tokens_to_logits(tokens, cache):
    return _decoder_step(params, config, tokens, cache, context)

  return _saying_vocab_size(tokens_to_logits, config)


def transformer_tokens_to_logits(params, config: TransformerConfig, encoded,
                                 src_mask) -> TokensToLogits:
  """The decoder of Transformer(config) as a one-step function with a cache.

  Args:
    params: the model parameters.
    config: the model's config.
    encoded: dtype[batch, src_len, d_model], the encoder output, one row per
      sentence.
    src_mask: bool[batch, 1, 1, src_len].

  Returns:
    tokens_to_logits(int32[rows, 1] tokens, cache) -> (float32[rows, vocab]
    logits of the next token, new cache), for a cache from
    `init_cache(config, rows, max_len)`, rows = batch * k: k decoded
    sequences per sentence, consecutive (a beam search's beams,
    `expand_to_beams`'s order). The cross-attention keys and values are
    projected once, here (`project_cross_kv`), one row per sentence that
    its k rows' queries read together (`attention.grouped_attention`):
    repeating them per beam would read them k times at every step.
  """
  return context_tokens_to_logits(params, config, {
      'cross_kv': project_cross_kv(params, config, encoded, src_mask),
      'src_mask': src_mask})


def slot_cache(params, src, config: TransformerConfig, max_len: int):
  """What a search slot holds of each source before its first step.

  src: int32[k, src_len] -> (cache, context) as `search.start_slots` and
  `search.fill_slots` take them, each leaf [k, ...]: the cache is the
  decoder's, empty, for max_len steps (`init_cache`); the context is
  `source_context`'s. A slot's source changes when it is refilled, so what
  the decoder attends to travels with the state, not in the step function
  (`slot_tokens_to_logits`).
  """
  check_max_len(config, max_len)
  context = source_context(params, src, config)  # src checked first
  return init_cache(config, src.shape[0], max_len), context


def slot_tokens_to_logits(params, config: TransformerConfig, max_len: int):
  """The decoder of Transformer(config) as a one-step function over search
  slots: (int32[rows, 1] tokens, cache, context) -> (float32[rows, vocab]
  logits, new cache), each slot's beams reading its source from its
  context together (`slot_cache`, one row per slot: rows = slots * beams,
  `attention.grouped_attention`)."""
  def tokens_to_logits(tokens, cache, context):
    # A slot whose sentence is done steps on with the others until it is
    # refilled; its position must stay inside the positional table.
    decoder = cache['decoder']
    cache = {'decoder': {**decoder, 'position': jnp.minimum(
        decoder['position'], max_len - 1)}}
    return _decoder_step(params, config, tokens, cache, context)

  return _saying_vocab_size(tokens_to_logits, config)


def check_max_len(config: TransformerConfig, max_len: int) -> None:
  """A clear error for a search longer than the positional-encoding table."""
  if not 0 < max_len <= config.max_len:
    raise ValueError(
        f'max_len={max_len}: must lie in [1, config.max_len={config.max_len}] '
        '(the positional-encoding table); train with a larger max_len to '
        'decode longer.')


def check_src(src, config: TransformerConfig) -> None:
  """A one-line ValueError for a source batch the entry points cannot take.

  src must be int[batch, src_len]; where its values are known (outside
  jit) every id must lie in the source vocabulary (under jit an id past it
  would be clamped silently by the embedding's gather).
  """
  shape, dtype = jnp.shape(src), jnp.result_type(src)
  if len(shape) != 2:
    raise ValueError(
        f'src of shape {shape}: expected int32[batch, src_len], one row of '
        'token ids per sentence (one sentence: src[None]).')
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f'src of dtype {dtype}: expected integer token ids.')
  if not isinstance(src, jax.core.Tracer) and np.size(src):
    values = np.asarray(src)
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= config.src_vocab_size:
      raise ValueError(
          f'src holds the id {high if high >= config.src_vocab_size else low}: '
          f'ids must lie in [0, src_vocab_size={config.src_vocab_size}) '
          '(encode with the run\'s own vocabulary).')


def encoded_for_search(params, src, config: TransformerConfig, max_len: int):
  """What a search needs from Transformer(config) for the sources src.

  src: int32[batch, src_len]. Runs the encoder once -> (tokens_to_logits for
  batch * k rows, k per sentence (beams or samples), consecutive, the empty
  cache for [batch, ...] and max_len steps).
  """
  check_max_len(config, max_len)
  return (context_tokens_to_logits(params, config,
                                   source_context(params, src, config)),
          init_cache(config, src.shape[0], max_len))


def greedy_decode(params, src, config: TransformerConfig, *,
                  max_len: int | None = None):
  """Greedy translation of a batch with Transformer(config) and `params`.

  Args:
    params: the model parameters.
    src: int32[batch, src_len], one sentence per row as it was trained:
      its token ids, then eos, then pad to the row's end (an id past the
      source vocabulary is refused where src is known, outside jit).
    config: the model's config (static under jit).
    max_len: output positions (static under jit); None: the batch's
      source length + 50, within config.max_len, each sentence cut at its
      own source length + 50 (`own_limits`), as beam_decode.

  Returns:
    int32[batch, max_len] output ids: the tokens, eos, then pad.
  """
  max_len, limits = _output_limits(src, config, max_len)
  tokens_to_logits, cache = encoded_for_search(params, src, config, max_len)
  return _cut_at_limits(
      greedy_search(tokens_to_logits, cache, batch_size=src.shape[0],
                    max_len=max_len, bos_id=config.bos_id,
                    eos_id=config.eos_id, pad_id=config.pad_id),
      limits, config.pad_id)


def tokens_before_eos(row, eos_id: int, pad_id: int) -> list[int]:
  """A decoded row (int32[max_len]) -> its tokens before eos, as a list
  (without eos: the row less its pad)."""
  tokens = list(map(int, row))
  if eos_id in tokens:
    return tokens[:tokens.index(eos_id)]
  return [t for t in tokens if t != pad_id]


def default_max_len(config: TransformerConfig, src_len: int) -> int:
  """The paper's limit, input length + 50, within the positional table
  (src_len may be a jax.export symbolic dimension)."""
  return jax.core.min_dim(src_len + 50, config.max_len)


def own_limits(src, config: TransformerConfig, max_len: int):
  """Each sentence's own output limit: int32[batch, src_len] -> int32[batch],
  its source length (tokens and eos, pad not counted) + 50, within max_len.

  A batch is as long as its longest source; with these limits a sentence's
  output does not depend on how far it was padded (the paper's input length
  + 50 per sentence).
  """
  length = jnp.sum(src != config.pad_id, axis=1, dtype=jnp.int32)
  return jnp.minimum(length + 50, max_len)


def _output_limits(src, config: TransformerConfig, max_len: int | None):
  """The entry points' output length and each sentence's limit: (max_len,
  None) where max_len is given; else (the batch's src_len + 50 within
  config.max_len, `own_limits`). src is checked first: a malformed one is
  named in one line before its shape is read."""
  check_src(src, config)
  if max_len is not None:
    return max_len, None
  max_len = default_max_len(config, src.shape[-1])
  return max_len, own_limits(src, config, max_len)


def _cut_at_limits(tokens, limits, pad_id: int):
  """int32[batch, ..., max_len] outputs with every position from each row's
  limit (int32[batch]; None: none) on set to pad: what a search that
  stopped there would have returned, since no token depends on a later
  one."""
  if limits is None:
    return tokens
  position = jnp.arange(tokens.shape[-1])
  limits = limits.reshape(limits.shape + (1,) * (tokens.ndim - 1))
  return jnp.where(position < limits, tokens, pad_id)


def beam_decode(params, src, config: TransformerConfig, *, beam_size: int = 4,
                alpha: float = 0.6, max_len: int | None = None,
                n_best: int = 1, finished_first: bool = True,
                stopping: str = DEFAULT_STOPPING,
                on_step: Callable[[BeamState], None] | None = None,
                grow_cache: bool = False) -> BeamSearchResult:
  """Beam search translation of a batch with Transformer(config) and `params`.

  The encoder runs once, and the cross-attention keys and values of its
  output are projected once, read by all of a sentence's beams together;
  the decoder runs one token per step with its key/value cache, reordered
  with the surviving beams. The paper's settings are the defaults: beam 4,
  alpha 0.6, and each sentence's output at most its source length + 50
  tokens.

  Args:
    params: the model parameters.
    src: int32[batch, src_len], one sentence per row as it was trained:
      its token ids, then eos, then pad to the row's end (an id past the
      source vocabulary is refused where src is known, outside jit).
    config: the model's config.
    max_len: every sentence's limit on output tokens (static under jit);
      None: each its own source length + 50 (`own_limits`, so a sentence's
      result does not depend on how far its batch is padded), the arrays
      as long as the batch's src_len + 50, within config.max_len.
    beam_size, alpha, n_best, finished_first, stopping, on_step:
      see `beam_search` (the translate command and evaluations use the
      run's config.eval_stopping, whose default is this one's). Under
      jax.jit, config, beam_size, max_len, n_best, stopping and grow_cache
      are static; alpha may be traced.
    grow_cache: grow the key/value cache in windows (`cache_windows`), as
      the translate command does: the same results up to float rounding,
      1.6x faster on CPU at max_len 66-98, for two or more loop bodies to
      compile instead of one. Under jax.export with a symbolic src_len it
      searches over arrays as long as config.max_len (the export does).

  Returns:
    BeamSearchResult: sequences int32[batch, n_best, max_len], scores
    float32[batch, n_best], lengths int32[batch, n_best] and reached_eos
    bool[batch, n_best].
  """
  check_sizes(beam_size=beam_size)  # before the encoder runs
  length, limits = _output_limits(src, config, max_len)
  # A window's length is compared with the arrays' when the program is
  # built, which a symbolic src_len + 50 (jax.export) cannot answer: there
  # the arrays are as long as the positional table, each row still limited
  # by its own limit, and the tokens cut to `length` after.
  symbolic = grow_cache and limits is not None and not isinstance(length,
                                                                  int)
  max_len = config.max_len if symbolic else length
  tokens_to_logits, cache = encoded_for_search(params, src, config, max_len)
  best = beam_search(
      tokens_to_logits, cache, batch_size=src.shape[0], beam_size=beam_size,
      max_len=max_len, alpha=alpha, bos_id=config.bos_id,
      eos_id=config.eos_id, pad_id=config.pad_id, n_best=n_best,
      finished_first=finished_first, stopping=stopping, on_step=on_step,
      windows=cache_windows(max_len) if grow_cache else None, limits=limits)
  if symbolic:
    return best.replace(sequences=best.sequences[..., :length])
  return best


def sample_decode(params, src, config: TransformerConfig, *, rng,
                  num_samples: int = 1, max_len: int | None = None,
                  temperature=1.0, top_k: int = 0, top_p=1.0):
  """Translations of a batch drawn from Transformer(config) (`sample_search`).

  Args:
    params: the model parameters.
    src: int32[batch, src_len], one sentence per row as it was trained:
      its token ids, then eos, then pad to the row's end.
    config: the model's config.
    rng: a PRNG key, or one per sentence (key[batch]): a sentence's samples
      then depend on its own key alone, not on the batch it is drawn in.
    num_samples: translations drawn per sentence (static).
    max_len: output positions (static); None: the batch's source length +
      50, each sentence cut at its own + 50, as greedy_decode.
    temperature, top_k, top_p: see `sample_search` (temperature 0 or top_k
      1: greedy).

  Returns:
    int32[batch, num_samples, max_len]: each the drawn tokens, eos, then pad.
  """
  check_sizes(num_samples=num_samples)
  max_len, limits = _output_limits(src, config, max_len)
  tokens_to_logits, _ = encoded_for_search(params, src, config, max_len)
  rows = src.shape[0] * num_samples
  keys = jax.vmap(lambda key: jax.random.split(key, num_samples))(
      keys_per_row(rng, src.shape[0]))
  tokens = sample_search(
      tokens_to_logits, init_cache(config, rows, max_len),
      rng=keys.reshape(rows), batch_size=rows, max_len=max_len,
      bos_id=config.bos_id, eos_id=config.eos_id, pad_id=config.pad_id,
      temperature=temperature, top_k=top_k, top_p=top_p)
  return _cut_at_limits(tokens.reshape(src.shape[0], num_samples, max_len),
                        limits, config.pad_id)
