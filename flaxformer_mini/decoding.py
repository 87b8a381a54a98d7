"""Decoding: what we feed in after training to get an output sentence.

The encoder runs once over the source; the cross-attention keys and values of
its output are projected once; then the decoder runs one token at a time,
reading and extending its key/value cache, inside the model-agnostic searches
of `search.py`: `greedy_decode`, `sample_decode` and `beam_decode` are those
searches with Transformer(config). They are plain traceable functions, so other JAX code
calls them under jax.jit, vmap or a mesh.

`translate_ids` and `translate_lines` decode many sentences at once, as the
translate command and a run's evaluations do: sorted by length into
batches, with the sentences whose beam search has ended leaving their batch
on the way.
"""

import dataclasses
import os
import resource
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.masks import padding_mask
from flaxformer_mini.model import Transformer
from flaxformer_mini.search import (BeamSearchResult, BeamState,
                                    TokensToLogits, beam_search,
                                    check_sizes, expand_to_beams, greedy_search,
                                    keys_per_row,
                                    run_beam_search, sample_search,
                                    start_beam_search, take_items)




def init_cache(config: TransformerConfig, batch_size: int, max_len: int):
  """The decoder's empty key/value cache for `max_len` steps of `batch_size` rows.

  -> a pytree of zeros: per decoder layer cached_key and cached_value
  dtype[batch, heads, max_len, d_k] (dtype: config.dtype), and the
  decoder's position int32[batch], each row's tokens fed so far.
  """
  model = Transformer(config)
  dummy_encoded = jnp.zeros((batch_size, 1, config.d_model), config.dtype)
  dummy_mask = jnp.ones((batch_size, 1, 1, 1), bool)
  dummy_tokens = jnp.zeros((batch_size, max_len), jnp.int32)
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.key(0), dummy_encoded, dummy_mask,
                         dummy_tokens, incremental=True,
                         method=Transformer.decode))['cache']
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


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


def transformer_tokens_to_logits(params, config: TransformerConfig, encoded,
                                 src_mask) -> TokensToLogits:
  """The decoder of Transformer(config) as a one-step function with a cache.

  Args:
    params: the model parameters.
    config: the model's config.
    encoded: dtype[rows, src_len, d_model], the encoder output, one row per
      decoded sequence (for beam search: each sentence's row repeated for its
      beams, `expand_to_beams`).
    src_mask: bool[rows, 1, 1, src_len].

  Returns:
    tokens_to_logits(int32[rows, 1] tokens, cache) -> (float32[rows, vocab]
    logits of the next token, new cache), for a cache from
    `init_cache(config, rows, max_len)`. The cross-attention keys and values
    are projected once, here (`project_cross_kv`).
  """
  model = Transformer(config)
  cross_kv = project_cross_kv(params, config, encoded, src_mask)

  def tokens_to_logits(tokens, cache):
    logits, variables = model.apply(
        {'params': params, 'cache': cache, 'cross_kv': cross_kv}, encoded,
        src_mask, tokens, incremental=True, mutable=['cache'],
        method=Transformer.decode)
    return logits[:, -1], variables['cache']

  return tokens_to_logits


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


def _encoded_for_search(params, src, config: TransformerConfig, max_len: int,
                        beams: int = 1):
  """What a search needs from Transformer(config) for the sources src.

  src: int32[batch, src_len]. Runs the encoder once -> (tokens_to_logits for
  batch * beams rows, the empty cache for [batch, ...] and max_len steps).
  """
  check_src(src, config)
  check_max_len(config, max_len)
  src_mask = padding_mask(src, config.pad_id)
  encoded = Transformer(config).apply({'params': params}, src, src_mask,
                                      method=Transformer.encode)
  if beams > 1:
    encoded = expand_to_beams(encoded, beams)
    src_mask = expand_to_beams(src_mask, beams)
  return (transformer_tokens_to_logits(params, config, encoded, src_mask),
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
    max_len: output positions (static under jit); None: source length + 50,
      within config.max_len, as beam_decode.

  Returns:
    int32[batch, max_len] output ids: the tokens, eos, then pad.
  """
  max_len = default_max_len(config, src.shape[-1]) if max_len is None else max_len
  tokens_to_logits, cache = _encoded_for_search(params, src, config, max_len)
  return greedy_search(tokens_to_logits, cache, batch_size=src.shape[0],
                       max_len=max_len, bos_id=config.bos_id,
                       eos_id=config.eos_id, pad_id=config.pad_id)


def tokens_before_eos(row, eos_id: int, pad_id: int) -> list[int]:
  """A decoded row (int32[max_len]) -> its tokens before eos, as a list
  (without eos: the row less its pad)."""
  tokens = list(map(int, row))
  if eos_id in tokens:
    return tokens[:tokens.index(eos_id)]
  return [t for t in tokens if t != pad_id]


def default_max_len(config: TransformerConfig, src_len: int) -> int:
  """The paper's limit, input length + 50, within the positional table."""
  return min(src_len + 50, config.max_len)


def beam_decode(params, src, config: TransformerConfig, *, beam_size: int = 4,
                alpha: float = 0.6, max_len: int | None = None,
                n_best: int = 1, finished_first: bool = True,
                on_step: Callable[[BeamState], None] | None = None
                ) -> BeamSearchResult:
  """Beam search translation of a batch with Transformer(config) and `params`.

  The encoder runs once, and the cross-attention keys and values of its
  output are projected once for every beam; the decoder runs one token per
  step with its key/value cache, reordered with the surviving beams. The
  paper's settings are the defaults: beam 4, alpha 0.6, max_len = source
  length + 50.

  Args:
    params: the model parameters.
    src: int32[batch, src_len], one sentence per row as it was trained:
      its token ids, then eos, then pad to the row's end (an id past the
      source vocabulary is refused where src is known, outside jit).
    config: the model's config.
    beam_size, alpha, max_len, n_best, finished_first, on_step: see
      `beam_search`. Under jax.jit, config, beam_size, max_len and n_best
      are static (shapes); alpha may be traced.

  Returns:
    BeamSearchResult: sequences int32[batch, n_best, max_len], scores
    float32[batch, n_best], lengths int32[batch, n_best] and reached_eos
    bool[batch, n_best].
  """
  check_sizes(beam_size=beam_size)  # before the encoder output is repeated
  max_len = default_max_len(config, src.shape[-1]) if max_len is None else max_len
  tokens_to_logits, cache = _encoded_for_search(params, src, config, max_len,
                                                beam_size)
  return beam_search(
      tokens_to_logits, cache, batch_size=src.shape[0], beam_size=beam_size,
      max_len=max_len, alpha=alpha, bos_id=config.bos_id,
      eos_id=config.eos_id, pad_id=config.pad_id, n_best=n_best,
      finished_first=finished_first, on_step=on_step)


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
    max_len: output positions (static); None: source length + 50.
    temperature, top_k, top_p: see `sample_search` (temperature 0 or top_k
      1: greedy).

  Returns:
    int32[batch, num_samples, max_len]: each the drawn tokens, eos, then pad.
  """
  check_sizes(num_samples=num_samples)
  max_len = default_max_len(config, src.shape[-1]) if max_len is None else max_len
  tokens_to_logits, _ = _encoded_for_search(params, src, config, max_len,
                                            num_samples)
  rows = src.shape[0] * num_samples
  keys = jax.vmap(lambda key: jax.random.split(key, num_samples))(
      keys_per_row(rng, src.shape[0]))
  tokens = sample_search(
      tokens_to_logits, init_cache(config, rows, max_len),
      rng=keys.reshape(rows), batch_size=rows, max_len=max_len,
      bos_id=config.bos_id, eos_id=config.eos_id, pad_id=config.pad_id,
      temperature=temperature, top_k=top_k, top_p=top_p)
  return tokens.reshape(src.shape[0], num_samples, max_len)


# The translation of many sentences: the translate command and evaluations.


def _start_beams(config: TransformerConfig, batch_size: int, beam_size: int,
                 max_len: int) -> BeamState:
  """Transformer(config)'s beam search before its first step."""
  check_max_len(config, max_len)
  return start_beam_search(init_cache(config, batch_size, max_len),
                           batch_size=batch_size, beam_size=beam_size,
                           max_len=max_len, bos_id=config.bos_id,
                           pad_id=config.pad_id)


def _run_beams(params, src, state: BeamState, config: TransformerConfig,
               alpha: float, until_searching: int,
               finished_first: bool) -> BeamState:
  """`run_beam_search` with Transformer(config) on the sources src, one row
  per item of `state` (after `take_items`, the sources of the items kept).
  The encoder runs on src again, once per stage: one pass, cheap next to the
  decoder's steps."""
  beams = state.live_log_probs.shape[1]
  tokens_to_logits, _ = _encoded_for_search(params, src, config,
                                            state.max_len, beams)
  return run_beam_search(
      tokens_to_logits, state, alpha=alpha, bos_id=config.bos_id,
      eos_id=config.eos_id, pad_id=config.pad_id,
      until_searching=until_searching, finished_first=finished_first)


# One jitted program per shape for the process: a later call (the next
# evaluation, the next input) with the same shapes reuses the compiled one.
_jit_greedy = jax.jit(greedy_decode, static_argnames=('config', 'max_len'))
_jit_sample = jax.jit(sample_decode, static_argnames=(
    'config', 'num_samples', 'max_len', 'top_k'))
_jit_start_beams = jax.jit(_start_beams, static_argnums=(0, 1, 2, 3))
_jit_run_beams = jax.jit(_run_beams, static_argnames=(
    'config', 'alpha', 'until_searching', 'finished_first'))
_jit_take_items = jax.jit(take_items)


def search_bytes(config: TransformerConfig, batch_size: int,
                 beam_size: int) -> int:
  """About how much device memory a beam search of `batch_size` sources of
  up to config.max_len tokens takes with `beam_size` beams.

  Per beam row: the key/value caches of self- and cross-attention (the
  self-attention cache twice, as it is reordered with the beams), float32
  logits, log-probabilities and candidates over the vocabulary, and the
  live, finished and candidate sequences.
  """
  rows = batch_size * beam_size
  itemsize = jnp.dtype(config.dtype).itemsize
  layer_cache = 2 * config.max_len * config.d_model * itemsize  # keys, values
  per_row = (config.num_decoder_layers * layer_cache * 3 +
             3 * config.tgt_vocab_size * 4 + 8 * (config.max_len + 1) * 4)
  return rows * per_row


def device_memory_bytes() -> int | None:
  """The memory of this process's first device (a CPU's: the host's, within
  the process's address-space limit), or None where it is not known."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  if device.platform != 'cpu':
    return None
  limits = [os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')]
  address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
  if address_space != resource.RLIM_INFINITY:
    limits.append(address_space)
  return min(limits)


def _next_rows(rows: int) -> int:
  """The rows of the next stage: a quarter, rounded up to a multiple of 8
  (0: this stage is the last).

  A quarter, not a half: each stage's batch shape is one more program to
  compile, and on the Multi30k test set 64 -> 16 rows saves almost all that
  64 -> 32 -> 16 -> 8 does (docs/multi30k.md).
  """
  return 0 if rows <= 16 else -(-rows // 32) * 8


def _beam_search_in_stages(params, src: np.ndarray, config: TransformerConfig,
                           beam_size: int, alpha: float, max_len: int,
                           shrink: bool, finished_first: bool) -> np.ndarray:
  """The best hypothesis of each source: int32[rows, src_len] -> [rows, max_len].

  One beam search in stages: once no more than a quarter of its items are
  still searching, the finished ones are collected and the rest go on alone
  in a batch a quarter the size, so sentences that end early stop paying for
  the slowest one. Each item's result is the one-batch search's (an item's
  search never looks at another's). shrink=False: one stage.
  """
  best = np.zeros((src.shape[0], max_len), np.int32)
  owner = np.arange(src.shape[0])  # the source row of each state row
  state = _jit_start_beams(config, src.shape[0], beam_size, max_len)
  while True:
    rows = _next_rows(len(owner)) if shrink else 0
    state = _jit_run_beams(params, src[owner], state, config, alpha,
                           until_searching=rows, finished_first=finished_first)
    finished = np.asarray(state.finished_sequences[:, 0, 1:])
    ended = np.asarray(state.done) | (int(state.step) >= max_len) | (rows == 0)
    best[owner[ended]] = finished[ended]
    searching = np.flatnonzero(~ended)
    if not len(searching):
      return best
    # Filler rows repeat a searching item: the same search, the same result.
    keep = np.resize(searching, rows)
    state = _jit_take_items(state, keep)
    owner = owner[keep]


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Translations drawn from the model instead of searched (`sample_decode`).

  Sentence i of a call draws with the key fold_in(key(seed), i): its samples
  are the same whatever the batch it lands in.
  """
  seed: int = 0
  num_samples: int = 1  # translations per sentence
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0


def _length_batches(config: TransformerConfig, sources: list[list[int]],
                    batch_size: int):
  """The non-empty sources sorted by length into batches: yields (members,
  src int32[batch_size, length]), member r's ids + eos in row r.

  Lengths are rounded up to multiples of 16 to bound the number of shapes,
  hence of programs to compile; rows past the last member repeat the first
  (their outputs are dropped); sources longer than config.max_len - 1 are
  cut there.
  """
  limit = config.max_len - 1  # room for eos
  order = sorted((i for i, ids in enumerate(sources) if len(ids)),
                 key=lambda i: len(sources[i]))
  for start in range(0, len(order), batch_size):
    members = order[start:start + batch_size]
    longest = min(max(len(sources[i]) for i in members) + 1, config.max_len)
    length = min(-(-longest // 16) * 16, config.max_len)
    src = np.full((batch_size, length), config.pad_id, np.int32)
    for row in range(batch_size):
      member = members[row] if row < len(members) else members[0]
      ids = list(sources[member][:limit]) + [config.eos_id]
      src[row, :len(ids)] = ids
    yield members, src


def _draw(params, src, members: list[int], config: TransformerConfig,
          sampling: Sampling, max_len: int) -> np.ndarray:
  """sample_decode with each member's own key: -> int32[rows, n, max_len]."""
  # Filler rows past the members repeat the first, as _length_batches fills them.
  rows = members + members[:1] * (len(src) - len(members))
  keys = jax.vmap(jax.random.fold_in, (None, 0))(
      jax.random.key(sampling.seed), jnp.asarray(rows, jnp.uint32))
  return np.asarray(_jit_sample(
      params, src, config, rng=keys, num_samples=sampling.num_samples,
      max_len=max_len, temperature=sampling.temperature, top_k=sampling.top_k,
      top_p=sampling.top_p))


def translate_ids(params, config: TransformerConfig, sources: list[list[int]],
                  *, beam_size: int = 4, alpha: float | None = None,
                  batch_size: int = 64, shrink_batches: bool = True,
                  finished_first: bool = True,
                  sampling: Sampling | None = None) -> list[list[int]]:
  """The best translation of each source (token ids, no eos), in order.

  Each source is its token ids without eos (eos and pad are added here).
  alpha None: the config's eval_alpha, as the translate command and a
  run's evaluations decode.

  Sources are sorted by length into batches of `batch_size`, so that the
  sentences of a batch are padded little and tend to end at similar steps
  (`_length_batches`). With shrink_batches the sentences whose beam search
  has ended leave their batch on the way (`_beam_search_in_stages`): the
  same translations as one stage (shrink_batches=False), 1.4x faster on the
  Multi30k test set once compiled, for a second program per batch shape.
  beam_size 1 is greedy search; finished_first: see `beam_search`. With
  `sampling`, translations are drawn instead, sampling.num_samples per
  source, consecutive in the list returned. An empty source gives an empty
  translation; sources longer than config.max_len - 1 are cut there.
  """
  alpha = config.eval_alpha if alpha is None else alpha
  draws = sampling.num_samples if sampling else 1
  # Parameters of any origin (a host copy, as averaging gives, or a training
  # state's device copy) become arrays on one device: a jitted program is
  # compiled per placement of its arguments, and is reused only for the same.
  params = jax.device_put(params, jax.local_devices()[0])
  outputs = [[] for _ in range(len(sources) * draws)]
  for members, src in _length_batches(config, sources, batch_size):
    max_len = default_max_len(config, src.shape[1])
    if sampling:
      best = _draw(params, src, members, config, sampling, max_len)
    elif beam_size == 1:
      best = np.asarray(_jit_greedy(params, src, config, max_len=max_len))
    else:
      best = _beam_search_in_stages(params, src, config, beam_size, alpha,
                                    max_len, shrink_batches, finished_first)
    best = best.reshape(len(src), draws, max_len)
    for row, i in enumerate(members):
      for draw in range(draws):
        outputs[i * draws + draw] = tokens_before_eos(
            best[row, draw], config.eos_id, config.pad_id)
  return outputs


def translate_lines(params, config: TransformerConfig, tokenizer,
                    lines: list[str], *, beam_size: int = 4,
                    alpha: float | None = None, batch_size: int = 64,
                    warn=None, finished_first: bool = True,
                    sampling: Sampling | None = None) -> list[str]:
  """Translations of `lines`, in order; '' for an empty line.

  tokenizer: the run's sentencepiece.SentencePieceProcessor (`load_run`).
  Sources longer than config.max_len - 1 tokens are cut there and reported
  through `warn(line_number, length)`. See translate_ids for the search:
  alpha None is the config's eval_alpha, as the translate command uses; with
  `sampling`, sampling.num_samples translations per line, consecutive.
  """
  encoded = [tokenizer.encode(line.strip()) if line.strip() else []
             for line in lines]
  for number, ids in enumerate(encoded, start=1):
    if len(ids) > config.max_len - 1 and warn is not None:
      warn(number, len(ids))
  return [tokenizer.decode(ids) for ids in translate_ids(
      params, config, encoded, beam_size=beam_size, alpha=alpha,
      batch_size=batch_size, finished_first=finished_first,
      sampling=sampling)]
