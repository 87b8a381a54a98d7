"""Greedy search, sampling and beam search over any model: a tokens -> logits
function and a cache.

The searches never look inside the model (as in T5X): they take a function
`tokens_to_logits(tokens, cache) -> (logits, new_cache)` and the cache it
reads and writes, so any decoder can use them. Each is one jax.lax.while_loop,
so a whole search runs on the device and can be jitted, vmapped or sharded by
the caller. `decoding.py` builds that function from the Transformer.

No search ever emits pad (the filler after eos) or bos (it only starts a
sequence); scores stay the model's own log-probabilities.

Beam search carries a cache with one row per beam: every leaf is
[batch * beams, ...], each item's beams consecutive, except scalar leaves
(say, a model's step counter), which all beams share (`_map_beam_rows`).
A model whose cache has a position axis can let beam search grow it in
windows (`CacheWindows`), so that a step reads and reorders only the
positions written so far, not all max_len of them.
"""

import dataclasses
import math
from typing import Any, Callable

import flax.struct
import jax
import jax.export
import jax.numpy as jnp
import numpy as np

from flaxformer_mini.config import DEFAULT_STOPPING, STOPPING_RULES
from flaxformer_mini.cpu_kernels import as_bits

# (int32[rows, 1] the last tokens, cache) -> (float[rows, vocab] logits, cache)
TokensToLogits = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


def _forbid(scores, token_ids):
  """Sets scores[..., id] = -inf for each id: float32[..., vocab] -> the same."""
  return scores.at[..., jnp.asarray(token_ids)].set(-jnp.inf)


def check_sizes(**sizes: int) -> None:
  """A one-line ValueError for a size that is not a positive int (or a
  symbolic dimension, as jax.export traces one)."""
  for name, size in sizes.items():
    if jax.export.is_symbolic_dim(size):
      continue
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      raise ValueError(f'{name}={size!r}: must be a positive int (a shape, '
                       'static under jit).')


def _check_cache_rows(cache, batch_size: int, name: str = 'cache',
                      why: str = 'the search repeats it over beams itself'
                      ) -> None:
  """The cache (or a slot's context) comes with one row per batch item, not
  per beam."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
    if jnp.ndim(leaf) and jnp.shape(leaf)[0] != batch_size:
      raise ValueError(
          f'{name}{jax.tree_util.keystr(path)} has {jnp.shape(leaf)[0]} rows; '
          f'every non-scalar leaf must be [batch_size={batch_size}, ...] '
          f'({why}).')


def _check_model(tokens_to_logits: TokensToLogits, cache, rows: int,
                 **ids: int) -> None:
  """One-line ValueErrors, before the loop is traced, for logits of another
  shape than [rows, vocab] (or [rows, 1, vocab]) and for a bos_id, eos_id or
  pad_id outside the vocabulary (first known here, from the logits' shape).

  A tokens_to_logits that says its `vocab_size` (the Transformer's,
  `decoding.transformer_tokens_to_logits`) gives logits of one row per
  token by construction, and is not traced apart for its shape: that trace
  costs as much as the step's own, a third of a second for the Multi30k
  model, in every program that searches.
  """
  if hasattr(tokens_to_logits, 'vocab_size'):
    returned = (rows, tokens_to_logits.vocab_size)
  else:
    returned = jax.eval_shape(
        tokens_to_logits, jax.ShapeDtypeStruct((rows, 1), jnp.int32),
        cache)[0].shape
  shape = returned
  if len(shape) == 3 and shape[1] == 1:
    shape = (shape[0], shape[2])
  if len(shape) != 2 or shape[0] != rows:
    raise ValueError(
        f'tokens_to_logits returned logits of shape {returned}; expected '
        f'[rows={rows}, vocab].')
  for name, token in ids.items():
    if not 0 <= token < shape[1]:
      raise ValueError(f'{name}={token}: outside the vocabulary of {shape[1]} '
                       'tokens that tokens_to_logits scores.')


def _float32_logits(logits):
  """float[rows, vocab] or [rows, 1, vocab] (the Flax WMT example's habit)
  -> float32[rows, vocab]."""
  return (logits[:, 0] if logits.ndim == 3 else logits).astype(jnp.float32)


def _argmax(x):
  """jnp.argmax over the last axis (the first index of the largest, or of
  the first NaN): float[rows, n] -> int32[rows]. A maximum, then the least
  index that holds it: XLA's CPU argmax, one reduction over (value, index)
  pairs, took 3x as long over a vocabulary (docs/performance.md,
  "Sampling and greedy search")."""
  top = jnp.max(x, axis=-1, keepdims=True)
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]),
                 axis=-1)


def _categorical(key, logits):
  """jax.random.categorical(key, logits) for float32[n] logits: the
  Gumbel-max draw, argmax(gumbel + logits), taken with `_argmax` (the same
  tokens, 3x faster on a CPU)."""
  return _argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def greedy_search(tokens_to_logits: TokensToLogits, cache, *, batch_size: int,
                  max_len: int, bos_id: int, eos_id: int, pad_id: int):
  """Picks the most likely next token until eos or max_len.

  Args:
    tokens_to_logits: (int32[batch, 1] last tokens, cache) ->
      (float[batch, vocab] next-token logits, new cache).
    cache: the decoder state before the first step; every non-scalar leaf
      [batch, ...].
    batch_size: number of sequences.
    max_len: number of output positions.
    bos_id, eos_id, pad_id: the first input token, the token that ends a
      sequence, and the filler after it.

  Returns:
    int32[batch, max_len]: each row is the output tokens, eos included if
    generated, then pad. The loop stops once every row has ended.
  """
  return _token_by_token(
      tokens_to_logits, cache, lambda logits, step: _argmax(logits),
      batch_size=batch_size, max_len=max_len, bos_id=bos_id, eos_id=eos_id,
      pad_id=pad_id)


def sample_search(tokens_to_logits: TokensToLogits, cache, *, rng,
                  batch_size: int, max_len: int, bos_id: int, eos_id: int,
                  pad_id: int, temperature=1.0, top_k: int = 0, top_p=1.0):
  """Draws each next token from the model's distribution until eos or max_len.

  The distribution is softmax(logits / temperature) over pad and bos
  excluded, cut to the top_k most likely tokens and then to the smallest
  set whose probability reaches top_p (nucleus sampling), renormalised.

  Args:
    tokens_to_logits, cache, batch_size, max_len, bos_id, eos_id, pad_id:
      as in `greedy_search`.
    rng: a PRNG key, or one per row (key[batch_size]): a row's tokens then
      depend on its own key alone, not on the batch it is drawn in.
    temperature: float >= 0, may be traced (vmap over it works); 0 is
      greedy search.
    top_k: keep the k most likely tokens (static; 0: all). 1 is greedy.
    top_p: float in (0, 1], may be traced; 1: all tokens.

  Returns:
    int32[batch, max_len]: each row the drawn tokens, eos included if drawn,
    then pad.
  """
  row_keys = keys_per_row(rng, batch_size)
  if top_k:
    check_sizes(top_k=top_k)
  # Where they are known (not traced), a temperature below 0 or a top_p
  # outside (0, 1] would draw from no distribution at all.
  if not isinstance(temperature, jax.core.Tracer) and not temperature >= 0:
    raise ValueError(f'temperature={temperature}: must be at least 0.')
  if not isinstance(top_p, jax.core.Tracer) and not 0 < top_p <= 1:
    raise ValueError(f'top_p={top_p}: must lie in (0, 1].')

  def draw(logits, step):
    def drawn(logits):
      # The guard keeps a vmapped temperature of 0, whose draw is computed
      # and thrown away, from dividing by 0.
      logits = _top_p(_top_k(
          logits / jnp.where(temperature > 0, temperature, 1), top_k), top_p)
      keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)
      return jax.vmap(_categorical)(keys, logits)

    # One of the two per step (both only under a vmap over temperature).
    return jax.lax.cond(temperature > 0, drawn, _argmax, logits)

  return _token_by_token(
      tokens_to_logits, cache, draw, batch_size=batch_size, max_len=max_len,
      bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)


def keys_per_row(rng, rows: int):
  """A PRNG key split into key[rows], or key[rows] as it is; a raw
  uint32[..., 2] key (jax.random.PRNGKey) is taken too."""
  if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)
  keys = jax.random.split(rng, rows) if rng.ndim == 0 else rng
  if keys.shape != (rows,):
    raise ValueError(f'rng of shape {rng.shape}: expected one key or one per '
                     f'row, [{rows}].')
  return keys


def _top_k(logits, k: int):
  """float32[rows, vocab] with every logit below the k-th largest of its row
  at -inf (k = 0: unchanged)."""
  if not k or k >= logits.shape[-1]:
    return logits
  kth = jax.lax.top_k(logits, k)[0][:, -1:]
  return jnp.where(logits < kth, -jnp.inf, logits)


def _order_keys(x):
  """float32[...] -> int32[...] in the same order: a float's bits, the
  negative ones' magnitude bits flipped (-0.0 taken as 0.0)."""
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
  return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _top_p(logits, p):
  """float32[rows, vocab] with -inf outside the smallest set of most likely
  tokens whose probability reaches p (the most likely token always kept,
  and every token as likely as one kept); p >= 1: every token, unchanged.

  A token is kept where the tokens more likely than it hold less than p.
  That mass only falls as the logit rises, so the least logit kept is found
  by bisection over the float32 values (as int32 keys in the same order):
  32 halvings, each a masked sum over the vocabulary, where sorting every
  row's vocabulary took 30x as long on a CPU.
  """
  def nucleus(logits):
    keys = _order_keys(logits)
    probs = jax.nn.softmax(logits, axis=-1)

    def halve(_, bounds):
      # The least key kept lies in [low, high]: high is kept, and so is
      # every key above it.
      low, high = bounds
      middle = (low >> 1) + (high >> 1) + (low & high & 1)  # no overflow
      kept = jnp.sum(jnp.where(keys > middle, probs, 0), axis=-1,
                     keepdims=True) < p
      return jnp.where(kept, low, middle + 1), jnp.where(kept, middle, high)

    low = jnp.full((logits.shape[0], 1), jnp.iinfo(jnp.int32).min)
    high = jnp.max(keys, axis=-1, keepdims=True)  # nothing above it: kept
    _, least = jax.lax.fori_loop(0, 32, halve, (low, high))
    return jnp.where(keys < least, -jnp.inf, logits)

  # p is often traced (one program for every value); where it keeps every
  # token, the nucleus is skipped on the device.
  return jax.lax.cond(p < 1, nucleus, lambda logits: logits, logits)


def _token_by_token(tokens_to_logits: TokensToLogits, cache, pick, *,
                    batch_size: int, max_len: int, bos_id: int, eos_id: int,
                    pad_id: int):
  """The loop of greedy search and sampling: pick(float32[batch, vocab]
  logits without pad and bos, int32[] step) -> int[batch] next tokens, until
  every row has drawn eos or max_len tokens; pad after eos."""
  check_sizes(batch_size=batch_size, max_len=max_len)
  _check_cache_rows(cache, batch_size)
  _check_model(tokens_to_logits, cache, batch_size, bos_id=bos_id,
               eos_id=eos_id, pad_id=pad_id)
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
    logits, cache = tokens_to_logits(last, cache)
    logits = _forbid(_float32_logits(logits), [pad_id, bos_id])  # [batch, vocab]
    next_token = pick(logits, step).astype(jnp.int32)  # [batch]
    next_token = jnp.where(finished, pad_id, next_token)
    tokens = jax.lax.dynamic_update_slice(tokens, next_token[:, None],
                                          (0, step + 1))
    return step + 1, tokens, cache, finished | (next_token == eos_id)

  _, tokens, _, _ = jax.lax.while_loop(
      not_done, one_token, (jnp.asarray(0), tokens, cache, finished))
  return tokens[:, 1:]


@dataclasses.dataclass(frozen=True)
class CacheWindows:
  """How beam search grows a cache with a position axis, window by window.

  A step attends over its whole cache and reorders it with the surviving
  beams, so a cache of max_len positions costs max_len positions' reading
  and writing at every step, however few are written. With windows the
  search runs its steps in chunks: the steps before lengths[0] on the
  cache's first lengths[0] positions, then up to lengths[1] on its first
  lengths[1], and so on (one while_loop each, one more loop body for the
  compiler each). The results are the same.

  Attributes:
    lengths: increasing window lengths; steps past the last run on the
      whole cache.
    take: (cache, length) -> the cache with only its first `length`
      positions (leaves without a position axis as they are).
    put: (cache, window) -> the cache with `window`, as `take` returned it
      and the steps changed it, written over its first positions.
  """
  lengths: tuple[int, ...]
  take: Callable[[Any, int], Any]
  put: Callable[[Any, Any], Any]


def doubling_windows(max_len: int, first: int = 24) -> tuple[int, ...]:
  """Window lengths first, 2 first, 4 first, ... up to 3/4 of max_len:
  (24, 48) for max_len 66 to 98, (24, 48, 96, 192) for 256. Each window
  at least halves what the steps in it read, for one more loop body to
  compile; a window past 3/4 of max_len would save too little for that."""
  lengths = []
  while first <= max_len * 3 / 4:
    lengths.append(first)
    first *= 2
  return tuple(lengths)


@flax.struct.dataclass
class BeamSearchResult:
  """The n best hypotheses of each batch item, best first.

  Attributes:
    sequences: int32[batch, n_best, max_len], tokens, eos if reached, then pad.
    scores: float32[batch, n_best], log p(sequence) / length_penalty(length).
    lengths: int32[batch, n_best], generated tokens, eos included.
    reached_eos: bool[batch, n_best]; False for a hypothesis that was cut at
      its item's limit (max_len, or its own `limits` entry) without eos
      (scored the same way, with that length).
  """
  sequences: jax.Array
  scores: jax.Array
  lengths: jax.Array
  reached_eos: jax.Array


@flax.struct.dataclass
class BeamState:
  """What beam search carries from one step to the next: two pools per item.

  Sequences hold bos in column 0: after `step` steps, columns 0..step of a
  live sequence are what the decoder has been fed, and column `step` is the
  token it reads next.
  """
  step: jax.Array                # int32[]: tokens generated so far
                                 # (int32[batch] in slots: each item's)
  live_sequences: jax.Array      # int32[batch, beams, max_len + 1]
  live_log_probs: jax.Array      # float32[batch, beams]: log p, best first
  finished_sequences: jax.Array  # int32[batch, beams, max_len + 1]
  finished_scores: jax.Array     # float32[batch, beams]: log p / lp; -inf: empty
  finished_lengths: jax.Array    # int32[batch, beams]: tokens, eos included
  finished_eos: jax.Array        # bool[batch, beams]: False: cut at limit
  done: jax.Array                # bool[batch]: ended by the stopping rule
  limit: jax.Array               # int32[batch]: each item's tokens at most
                                 # (<= max_len; cut there, and done)
  cache: Any                     # the decoder's cache, [batch * beams, ...] leaves
  max_len: int = flax.struct.field(pytree_node=False)  # positions to generate


def length_penalty(length, alpha: float):
  """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha: int32[...] -> float32[...].

  A hypothesis scores log p(Y) / lp(Y): alpha > 0 favours longer ones.
  """
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0)**alpha


def expand_to_beams(x, beam_size: int):
  """x: [batch, ...] -> [batch * beam_size, ...], each item's beams consecutive."""
  return jnp.repeat(x, beam_size, axis=0)


def _map_beam_rows(fn, cache):
  """fn applied to every cache leaf with a row per beam ([batch * beams, ...]);
  scalar leaves (shared by all beams, e.g. a step counter) stay as they are."""
  return jax.tree.map(lambda leaf: leaf if leaf.ndim == 0 else fn(leaf), cache)


def _gather_beams(x, beam_indices):
  """x: [batch, beams, ...], beam_indices: int32[batch, k] -> [batch, k, ...]."""
  return jax.vmap(lambda row, indices: row[indices])(x, beam_indices)


def _gather_cache(cache, beam_indices):
  """Reorders the cache's beam rows to follow beam_indices: int32[batch, beams]."""
  batch, beams = beam_indices.shape
  return _map_beam_rows(as_bits(
      lambda leaf: _gather_beams(leaf.reshape((batch, beams) + leaf.shape[1:]),
                                 beam_indices).reshape(leaf.shape)), cache)


def beam_search(tokens_to_logits: TokensToLogits, cache, *, batch_size: int,
                beam_size: int, max_len: int, alpha: float, bos_id: int,
                eos_id: int, pad_id: int, n_best: int = 1,
                finished_first: bool = True,
                stopping: str = DEFAULT_STOPPING,
                on_step: Callable[[BeamState], None] | None = None,
                windows: CacheWindows | None = None,
                limits=None) -> BeamSearchResult:
  """Beam search with a live and a finished pool, all in one lax.while_loop.

  Each step extends every live hypothesis by every token and keeps the top
  2 * beam_size candidates, so that hypotheses ending in eos never starve the
  live pool: the best beam_size candidates without eos stay live, and the eos
  candidates among the best beam_size enter the finished pool with score
  log p / length_penalty(length). On the last step the live hypotheses enter
  the finished pool too, flagged `reached_eos=False`, with the same scoring;
  by default (finished_first) they rank below every hypothesis that reached
  eos, as in the Flax WMT example and T5X.
  When an item is done is the `stopping` rule's choice (STOPPING_RULES); the
  loop stops when every item of the batch is done (or at max_len), so a batch
  runs as long as its slowest item.

  The search is three calls, start -> run -> result; a caller that wants the
  items that are done to leave on the way runs it in stages instead
  (`run_beam_search` with `until_searching`, then `take_items`).

  Args:
    tokens_to_logits: (int32[batch * beam, 1] last tokens, cache) ->
      (float[batch * beam, vocab] logits, new cache); rows are the beams of
      each item, consecutive. log_softmax runs in float32 here whatever the
      model's dtype.
    cache: the decoder state, every non-scalar leaf [batch, ...] (one row
      per item, not per beam); expanded over beams here (scalar leaves are
      shared by all beams).
    batch_size: number of batch items.
    beam_size: hypotheses kept per item.
    max_len: generated positions at most (the arrays' length).
    alpha: length-penalty exponent (0 = raw log-probabilities); may be
      traced (jax.vmap over alphas works).
    bos_id, eos_id, pad_id: first input token, end token, filler after eos.
    n_best: how many finished hypotheses to return per item (<= beam_size).
    finished_first: True: a hypothesis that reached eos outranks every one
      cut at max_len, so a cut one is returned only where fewer than n_best
      reached eos (the Flax WMT example's and T5X's rule). False: both kinds
      are ranked by score alone, so a cut hypothesis may come first.
    stopping: when an item is done (every rule also stops where the exact
      one does):
      'exact': no live hypothesis can still beat the n_best-th finished one,
        whatever length it ends at (its log p over the largest length
        penalty it could reach; the Flax WMT example's and GNMT's bound).
        The result is then the one an endless search would return.
      'beam_finished': beam_size hypotheses have finished (fairseq's rule,
        and CTranslate2's with a length penalty).
      'current_length': beam_size hypotheses have finished and the worst of
        them beats the best live hypothesis scored at its current length
        (Hugging Face's default, early_stopping=False): as if nothing live
        would grow longer.
      The default is 'current_length', here, in `decoding.beam_decode`, a
      run's evaluations and the translate command: on the Multi30k en->de
      recipe it returned the exact rule's translation for all but one or
      two sentences in a thousand (BLEU within 0.02) and searched 1.3-1.4x
      faster; 'beam_finished' was as fast but changed 1-3 % of them and
      lost up to 0.14 BLEU on validation at beam 4 (docs/performance.md,
      "Stopping rules"; benchmarks/stopping_rules.py).
    on_step: for watching the search, e.g. in the notebook: called on the
      host (jax.debug.callback) after every step with that step's BeamState
      (its cache left out). None costs nothing.
    windows: grow the cache window by window (`CacheWindows`): the same
      results, each step reading only a window of the cache; None: every
      step reads the whole cache, in one loop.
    limits: int32[batch], each item's own limit on generated tokens, in
      [1, max_len] (may be traced): its hypotheses are cut there, and its
      length penalty's bound is lp(limit), so an item whose limit is below
      max_len stops no later than with max_len (the paper's source length
      + 50 per sentence, in a batch padded to its longest). None: max_len
      for every item.

  Returns:
    A BeamSearchResult with [batch, n_best, ...] fields, best first.
  """
  check_sizes(batch_size=batch_size, beam_size=beam_size, max_len=max_len)
  _check_n_best(n_best, beam_size)
  state = start_beam_search(cache, batch_size=batch_size, beam_size=beam_size,
                            max_len=max_len, bos_id=bos_id, pad_id=pad_id,
                            limits=limits)
  state = run_beam_search(tokens_to_logits, state, alpha=alpha, bos_id=bos_id,
                          eos_id=eos_id, pad_id=pad_id, n_best=n_best,
                          finished_first=finished_first, stopping=stopping,
                          on_step=on_step, windows=windows)
  return beam_search_result(state, n_best)


def check_stopping(stopping: str) -> None:
  """A one-line ValueError for a stopping rule that is not one of ours."""
  if stopping not in STOPPING_RULES:
    raise ValueError(f'stopping={stopping!r}: choose one of '
                     f'{", ".join(map(repr, STOPPING_RULES))}.')


def _check_limits(limits, batch_size: int, max_len: int):
  """limits as int32[batch]: max_len where None; refused in one line where
  known (outside jit) and outside [1, max_len] or of another batch."""
  if limits is None:
    return jnp.full((batch_size,), max_len, jnp.int32)
  if jnp.shape(limits) != (batch_size,):
    raise ValueError(f'limits of shape {jnp.shape(limits)}: must be one per '
                     f'item, ({batch_size},).')
  if not isinstance(limits, jax.core.Tracer):
    values = np.asarray(limits)
    if values.min() < 1 or values.max() > max_len:
      raise ValueError(f'limits from {values.min()} to {values.max()}: each '
                       f'must lie in [1, max_len={max_len}].')
  return jnp.asarray(limits, jnp.int32)


def _check_n_best(n_best: int, beam_size: int) -> None:
  if not isinstance(n_best, int) or not 1 <= n_best <= beam_size:
    raise ValueError(f'n_best={n_best}: must lie in [1, beam_size={beam_size}].')


def start_beam_search(cache, *, batch_size: int, beam_size: int, max_len: int,
                      bos_id: int, pad_id: int, limits=None) -> BeamState:
  """The state before the first step: bos in every sequence, pools empty.

  cache: the decoder state, every non-scalar leaf [batch, ...]; expanded
  over beams here. The state's live_sequences and finished_sequences are
  int32[batch, beams, max_len + 1] (see BeamState). limits: int32[batch],
  each item's limit on generated tokens (see `beam_search`); None: max_len.
  """
  check_sizes(batch_size=batch_size, beam_size=beam_size, max_len=max_len)
  _check_cache_rows(cache, batch_size)
  limit = _check_limits(limits, batch_size, max_len)
  batch, beams = batch_size, beam_size
  # Column 0 holds bos; step i reads column i and writes column i + 1.
  sequences = jnp.full((batch, beams, max_len + 1), pad_id, jnp.int32)
  sequences = sequences.at[:, :, 0].set(bos_id)
  # Only beam 0 is alive at first, so the first step does not pick the same
  # token in every beam.
  live_log_probs = jnp.tile(
      jnp.array([0.0] + [-jnp.inf] * (beams - 1), jnp.float32), (batch, 1))
  return BeamState(
      step=jnp.asarray(0, jnp.int32),
      live_sequences=sequences,
      live_log_probs=live_log_probs,
      finished_sequences=sequences,
      finished_scores=jnp.full((batch, beams), -jnp.inf, jnp.float32),
      finished_lengths=jnp.zeros((batch, beams), jnp.int32),
      finished_eos=jnp.zeros((batch, beams), bool),
      done=jnp.zeros((batch,), bool),
      limit=limit,
      cache=_map_beam_rows(lambda leaf: expand_to_beams(leaf, beams), cache),
      max_len=max_len)


def run_beam_search(tokens_to_logits: TokensToLogits, state: BeamState, *,
                    alpha: float, bos_id: int, eos_id: int, pad_id: int,
                    until_searching: int = 0, n_best: int = 1,
                    finished_first: bool = True,
                    stopping: str = DEFAULT_STOPPING,
                    on_step: Callable[[BeamState], None] | None = None,
                    windows: CacheWindows | None = None,
                    past_windows: bool = True) -> BeamState:
  """Beam search steps from `state` until no item is still searching.

  Stops at state.max_len, or once at most `until_searching` items are still
  searching (not done; 0, the default: the whole search). A caller that
  stops early can keep the items still searching (`take_items`, with the
  tokens_to_logits of those items) and run on with fewer rows, so that items
  that end early stop paying for the slowest one; each item's search never
  looks at another's, so its result is the same either way. alpha, n_best
  (the hypotheses the caller will take), finished_first, stopping, on_step
  and windows: see `beam_search` (a state at any step may be run with
  windows: the windows its steps have passed are skipped).

  past_windows=False (with windows shorter than max_len) also stops at the
  last window's end instead of stepping on over the whole cache: one loop
  body less to compile, for a caller that goes on from the state in a later
  call where items are still searching there (the translate command's first
  stage, which on the Multi30k sets never gets that far).

  Returns the BeamState after the last step taken.
  """
  batch, beams = state.live_log_probs.shape
  max_len = state.max_len
  _check_n_best(n_best, beams)
  check_stopping(stopping)
  _check_model(tokens_to_logits, state.cache, batch * beams, bos_id=bos_id,
               eos_id=eos_id, pad_id=pad_id)

  def keep_going(state: BeamState):
    return (state.step < max_len) & (jnp.sum(~state.done) > until_searching)

  def one_step(state: BeamState) -> BeamState:
    new_state = _beam_step(tokens_to_logits, state, alpha=alpha, bos_id=bos_id,
                           eos_id=eos_id, pad_id=pad_id, n_best=n_best,
                           finished_first=finished_first, stopping=stopping)
    if on_step is not None:
      jax.debug.callback(on_step, new_state.replace(cache=None), ordered=True)
    return new_state

  if windows is None:
    return jax.lax.while_loop(keep_going, one_step, state)
  for length in windows.lengths:
    if length >= max_len:
      break

    def in_window(state, length=length):
      window = jax.lax.while_loop(
          lambda state: keep_going(state) & (state.step < length),
          one_step, state.replace(cache=windows.take(state.cache, length)))
      return window.replace(cache=windows.put(state.cache, window.cache))

    # Taking a window out and putting it back copies it whole: skipped
    # where no step would run in it (a stage that ends in an earlier
    # window, a state already past it), 5 % of a first stage of the
    # translate command (docs/performance.md, "A cache that grows").
    state = jax.lax.cond(keep_going(state) & (state.step < length),
                         in_window, lambda state: state, state)
  if not past_windows and any(length < max_len for length in windows.lengths):
    return state  # at the last window's end
  return jax.lax.while_loop(keep_going, one_step, state)


_ONCE_PER_SLOT = 'one row per item, read by all of its beams'


def start_slots(cache, context, *, slots: int, beam_size: int, max_len: int,
                bos_id: int, pad_id: int) -> BeamState:
  """Beam search in slots (continuous batching), every slot empty.

  A batch searched together runs as long as its slowest item. Slots do
  not wait: each searches its own item from its own step (state.step is
  int32[slots]), and a slot whose item is done takes the next item
  (`fill_slots`) while the others search on (`run_slots`). An item's result
  is the one it gets searched alone, as in a batch (an item's search never
  looks at another's). An empty slot counts as done.

  cache: the model's cache of an item before its first step, reordered
  with the beams at every step; context: what the model reads of an item
  but never changes (the Transformer: its source's cross-attention keys
  and values), the same for every beam, so kept once per slot and never
  reordered. Every non-scalar leaf of both is [slots, ...] (their values
  are replaced by each item's own in fill_slots). The state's cache is the
  pair (cache, context), the cache's leaves [slots * beams, ...], the
  context's [slots, ...]; its other fields are [slots, ...] as BeamState's
  are [batch, ...].
  """
  _check_cache_rows(context, slots, 'context', _ONCE_PER_SLOT)
  state = start_beam_search(cache, batch_size=slots, beam_size=beam_size,
                            max_len=max_len, bos_id=bos_id, pad_id=pad_id)
  return state.replace(step=jnp.zeros((slots,), jnp.int32),
                       done=jnp.ones((slots,), bool),
                       cache=(state.cache, context))


def fill_slots(state: BeamState, slots, cache, context, *, bos_id: int,
               pad_id: int, limits=None) -> BeamState:
  """Starts new items in the slots `slots` (int32[k]); the others search on.

  cache, context: the new items', as `start_slots` takes them, every
  non-scalar leaf [k, ...] (one row per item); scalar leaves stay the
  state's. A slot id past the last fills nothing, so that a caller with
  fewer than k new items keeps one shape, one compiled program. Whatever a
  filled slot held is gone: take its result first. limits: int32[k], the
  new items' limits on generated tokens (see `beam_search`); None: max_len.
  """
  batch, beams = state.live_log_probs.shape
  k = slots.shape[0]
  _check_cache_rows(context, k, 'context', _ONCE_PER_SLOT)
  fresh = start_beam_search(cache, batch_size=k, beam_size=beams,
                            max_len=state.max_len, bos_id=bos_id,
                            pad_id=pad_id, limits=limits).replace(
                                step=jnp.zeros((k,), jnp.int32))

  def put(old, new):  # [batch, ...] <- [k, ...] at rows `slots`
    return old if old.ndim == 0 else old.at[slots].set(new, mode='drop')

  def put_beam_rows(old, new):  # [batch * beams, ...] <- [k * beams, ...]
    by_item = old.reshape((batch, beams) + old.shape[1:])
    return put(by_item, new.reshape((k, beams) + new.shape[1:])
               ).reshape(old.shape)

  old_cache, old_context = state.cache
  both = (jax.tree.map(
      lambda old, new: old if old.ndim == 0 else put_beam_rows(old, new),
      old_cache, fresh.cache), jax.tree.map(put, old_context, context))
  return jax.tree.map(put, state.replace(cache=None),
                      fresh.replace(cache=None)).replace(cache=both)


def run_slots(tokens_to_logits, state: BeamState, *, until_done,
              alpha: float, bos_id: int, eos_id: int, pad_id: int,
              n_best: int = 1, finished_first: bool = True,
              stopping: str = DEFAULT_STOPPING) -> BeamState:
  """Steps every slot's search until at least `until_done` slots are done.

  tokens_to_logits: (int32[slots * beams, 1] last tokens, cache, context)
  -> (float[slots * beams, vocab] logits, new cache), as a
  `TokensToLogits` with the context ([slots, ...], one row for all of a
  slot's beams) beside its cache.
  until_done: int32[] (may be traced, one program for every value), at
  most the number of slots: a caller refills that many slots at a time,
  and asks for all of them once it has nothing left to fill. A slot that
  is done keeps its result; the model is still called on its rows (one
  shape for all), and whatever it writes there is unused until the slot
  is filled again. Every item is done after max_len steps, so the loop
  ends. alpha, n_best, finished_first, stopping: see `beam_search`.
  """
  slots, beams = state.live_log_probs.shape
  _check_n_best(n_best, beams)
  check_stopping(stopping)
  if isinstance(until_done, int) and not 0 <= until_done <= slots:
    raise ValueError(f'until_done={until_done}: must lie in [0, '
                     f'slots={slots}].')

  def with_context(tokens, both):
    cache, context = both
    logits, cache = tokens_to_logits(tokens, cache, context)
    return logits, (cache, context)
  if hasattr(tokens_to_logits, 'vocab_size'):
    with_context.vocab_size = tokens_to_logits.vocab_size

  def reorder(both, beam_indices):
    cache, context = both
    return _gather_cache(cache, beam_indices), context

  _check_model(with_context, state.cache, slots * beams, bos_id=bos_id,
               eos_id=eos_id, pad_id=pad_id)
  # A traced until_done past the slots would never be reached.
  until_done = jnp.minimum(until_done, slots)
  return jax.lax.while_loop(
      lambda state: jnp.sum(state.done) < until_done,
      lambda state: _beam_step(
          with_context, state, alpha=alpha, bos_id=bos_id, eos_id=eos_id,
          pad_id=pad_id, n_best=n_best, finished_first=finished_first,
          stopping=stopping, reorder=reorder), state)


def top_k_in_blocks(x, k: int, offsets=None, forbidden=()):
  """jax.lax.top_k over x's last axis, computed in blocks: the same values
  and indices, ties to the lower index; with offsets, the top k of x plus
  one offset per group, the groups side by side; forbidden: indices along
  x's last axis (Python ints) never chosen, as if x were -inf there.

  x: float[rows, n] -> (float[rows, k] values, int32[rows, k] indices); or
  x: float[rows, groups, n] and offsets float[rows, groups] -> the top k of
  (x + offsets[..., None]) over groups * n, indices group * n + i, that sum
  computed only for the blocks that may hold them (a beam step's
  candidates: every beam's logits, its live log p less its normalizer as
  its offset, never added over the whole vocabulary).

  XLA's CPU top_k orders its whole row: a beam step's 2 * beams best of
  beams * vocab candidates (40,000 for Multi30k's vocabulary at beam 4)
  took 16 µs a row, most of the search's selection. The k best lie in the
  k blocks with the largest maxima (each of them is, or is beaten by, its
  block's maximum), so: the maximum of each block of about sqrt(groups *
  n) values of one group, the k best blocks, then the k best of their
  k * block values (2 µs a row, benchmarks/cache_windows.py). The blocks
  are taken in index order, so equal values still come out lower index
  first.
  """
  if offsets is None:
    x, offsets = x[:, None], jnp.zeros((x.shape[0], 1), x.dtype)
  blocks = _Blocks(x, k)
  if blocks.too_few:
    x = x + offsets[..., None]
    return jax.lax.top_k((_forbid(x, list(forbidden)) if forbidden else x)
                         .reshape(x.shape[0], -1), k)
  return blocks.top_k(offsets, forbidden)


def best_extensions(logits, log_probs, k: int, forbidden=()):
  """The k best one-token extensions of every beam together: the top k of
  log_probs[..., None] + log_softmax(logits) over beams * vocab, the
  forbidden tokens (Python ints) never chosen.

  logits: float32[batch, beams, vocab], log_probs: float32[batch, beams]
  -> (float32[batch, k] log p, int32[batch, k] indices beam * vocab +
  token). The same as top_k_in_blocks of the logits with each beam's log p
  less its normalizer as its offset, with the normalizer's maximum taken
  from the blocks' maxima: one pass over [rows, vocab] fewer, and the
  forbidden tokens left out of the few blocks that hold them instead of
  written over in a copy of the logits (a pass that read and wrote them
  all): the logits' work after the projection 5.5 -> 1.9 µs per row-step
  at 256 rows on this project's CPU (docs/performance.md).
  """
  blocks = _Blocks(logits, k)
  if blocks.too_few:
    return top_k_in_blocks(logits, k, log_probs - jax.nn.logsumexp(
        logits, axis=-1), forbidden)
  # jax.nn.logsumexp's sum, about the maximum of the blocks' maxima. The
  # barrier keeps XLA from merging the two maxima into one reduction over
  # the logits, which would read them all again.
  peak = jax.lax.stop_gradient(
      jax.lax.optimization_barrier(blocks.maxima).max(-1))
  peak = jnp.where(jnp.isfinite(peak), peak, 0)
  normalizer = jnp.log(jnp.sum(jnp.exp(logits - peak[..., None]),
                               axis=-1)) + peak
  return blocks.top_k(log_probs - normalizer, forbidden)


class _Blocks:
  """x: float[rows, groups, n] cut into blocks of about sqrt(groups * n)
  values of one group, each group padded at its end with -inf (after every
  value, -inf included), with each block's maximum."""

  def __init__(self, x, k: int):
    rows, groups, self.n = x.shape
    self.k, self.block = k, max(1, math.isqrt(groups * self.n))
    self.per_group = -(-self.n // self.block)
    self.too_few = groups * self.per_group <= 2 * k  # little to leave out
    if self.too_few:
      return
    self.x = jnp.pad(x, ((0, 0), (0, 0), (0, self.per_group * self.block -
                                          self.n)),
                     constant_values=-jnp.inf).reshape(
                         rows, groups, self.per_group, self.block)
    self.maxima = self.x.max(-1)  # [rows, groups, per_group]

  def _without(self, forbidden):
    """The blocks' maxima, each forbidden index's block's taken again
    without it: [rows, groups * per_group]."""
    maxima = self.maxima
    for b in sorted({i // self.block for i in forbidden}):
      out = np.isin(b * self.block + np.arange(self.block), list(forbidden))
      maxima = maxima.at[:, :, b].set(
          jnp.where(out, -jnp.inf, self.x[:, :, b]).max(-1))
    return maxima.reshape(maxima.shape[0], -1)

  def top_k(self, offsets, forbidden):
    """The top k of x + offsets[..., None] (offsets: float[rows, groups])
    over groups * n, the forbidden indices of each group left out."""
    rows, per_group, block = offsets.shape[0], self.per_group, self.block
    group_of = lambda blocks: blocks // per_group
    maxima = self._without(forbidden) + jnp.repeat(offsets, per_group,
                                                   axis=1)
    best_blocks = jnp.sort(jax.lax.top_k(maxima, self.k)[1], axis=-1)
    x = self.x.reshape(rows, -1, block)
    candidates = (jnp.take_along_axis(x, best_blocks[:, :, None], axis=1) +
                  jnp.take_along_axis(offsets, group_of(best_blocks),
                                      axis=1)[:, :, None])
    # --> [rows, k, block]: each candidate's index within its group
    within = (best_blocks % per_group)[:, :, None] * block + jnp.arange(block)
    for i in forbidden:
      candidates = jnp.where(within == i, -jnp.inf, candidates)
    values, picks = jax.lax.top_k(candidates.reshape(rows, self.k * block),
                                  self.k)
    blocks = jnp.take_along_axis(best_blocks, picks // block, axis=1)
    return values, (group_of(blocks) * self.n + blocks % per_group * block +
                    picks % block)


def _read_column(sequences, step):
  """int32[batch, beams, max_len + 1] -> column `step` (int32[] or one per
  item, int32[batch]) of each: int32[batch, beams, 1]."""
  if step.ndim == 0:
    return jax.lax.dynamic_slice_in_dim(sequences, step, 1, axis=2)
  return jnp.take_along_axis(sequences, step[:, None, None], axis=2)


def _write_column(sequences, tokens, step):
  """sequences int32[batch, k, max_len + 1] with tokens int32[batch, k]
  written in column `step` (int32[] or int32[batch])."""
  if step.ndim == 0:
    return jax.lax.dynamic_update_slice(sequences, tokens[:, :, None],
                                        (0, 0, step))
  column = jnp.arange(sequences.shape[2]) == step[:, None, None]
  return jnp.where(column, tokens[:, :, None], sequences)


def _beam_step(tokens_to_logits: TokensToLogits, state: BeamState, *,
               alpha: float, bos_id: int, eos_id: int, pad_id: int,
               n_best: int, finished_first: bool, stopping: str,
               reorder=None) -> BeamState:
  """One step of every item's beam search: the state after it.

  state.step is int32[] (all items at one step) or int32[batch] (slots:
  each item at its own, `run_slots`; an item that is done stays at its
  step there). reorder(cache, int32[batch, beams] beam indices): how the
  cache follows the surviving beams (None: every leaf, `_gather_cache`).
  """
  batch, beams = state.live_log_probs.shape
  step = state.step
  # --> [batch * beams, 1]: the last token of every live hypothesis
  last = _read_column(state.live_sequences, step)
  logits, cache = tokens_to_logits(last.reshape(batch * beams, 1),
                                   state.cache)
  logits = _float32_logits(logits)
  vocab = logits.shape[-1]
  logits = logits.reshape(batch, beams, vocab)
  # log p of every one-token extension is live log p + log_softmax(logits):
  # the logits plus one offset per beam, added only where the best are
  # (two passes over [rows, vocab] fewer than adding it everywhere).
  # --> [batch, 2 * beams]: the best candidates over all beams at once
  top_log_probs, top_indices = best_extensions(
      logits, state.live_log_probs, 2 * beams, (pad_id, bos_id))
  top_beams = top_indices // vocab
  top_tokens = (top_indices % vocab).astype(jnp.int32)
  # --> [batch, 2 * beams, max_len + 1]: their sequences, new token written
  top_sequences = _write_column(_gather_beams(state.live_sequences, top_beams),
                                top_tokens, step + 1)
  is_eos = top_tokens == eos_id

  # The live pool: the best `beams` candidates that did not just end.
  # --> [batch, beams]
  live_log_probs, live_picks = jax.lax.top_k(
      jnp.where(is_eos, -jnp.inf, top_log_probs), beams)
  live_sequences = _gather_beams(top_sequences, live_picks)
  cache = (reorder or _gather_cache)(cache,
                                    _gather_beams(top_beams, live_picks))

  return _update_finished(
      state, top_sequences, jnp.where(is_eos, top_log_probs, -jnp.inf),
      live_sequences, live_log_probs, alpha, finished_first, n_best,
      stopping).replace(
          step=step + 1 if step.ndim == 0 else jnp.where(state.done, step,
                                                         step + 1),
          live_sequences=live_sequences, live_log_probs=live_log_probs,
          cache=cache)


def _update_finished(state: BeamState, top_sequences, eos_log_probs,
                     live_sequences, live_log_probs, alpha: float,
                     finished_first: bool, n_best: int,
                     stopping: str) -> BeamState:
  """The finished pool after one step: its old members, the eos candidates
  that made the top `beams`, and on the last step every live hypothesis (no
  eos); the best `beams` of them, best first (with finished_first, those
  that reached eos before those cut), and which items are done.

  top_sequences: int32[batch, 2 * beams, max_len + 1], the step's best
  candidates; eos_log_probs: float32[batch, 2 * beams], their log p where
  they just ended in eos (-inf elsewhere); live_sequences, live_log_probs:
  the new live pool, [batch, beams, ...].
  """
  batch, beams = live_log_probs.shape
  length = state.step + 1  # generated tokens after this step, eos included
  # --> [] or [batch, 1] (slots: each item's own), against [batch, k] pools
  row_length = length if length.ndim == 0 else length[:, None]
  made_beam = jnp.arange(2 * beams) < beams
  eos_scores = jnp.where(made_beam, eos_log_probs, -jnp.inf
                        ) / length_penalty(row_length, alpha)
  cut_scores = jnp.where(row_length == state.limit[:, None], live_log_probs,
                         -jnp.inf) / length_penalty(row_length, alpha)
  # --> [batch, 4 * beams]: everything that may be finished now
  pool_scores = jnp.concatenate(
      [state.finished_scores, eos_scores, cut_scores], axis=1)
  pool_sequences = jnp.concatenate(
      [state.finished_sequences, top_sequences, live_sequences], axis=1)
  pool_lengths = jnp.concatenate(
      [state.finished_lengths,
       jnp.broadcast_to(row_length, (batch, 3 * beams))], axis=1)
  pool_eos = jnp.concatenate(
      [state.finished_eos, jnp.ones((batch, 2 * beams), bool),
       jnp.zeros((batch, beams), bool)], axis=1)
  # --> [batch, beams]: the best of them, best first
  picks = _rank(pool_scores, pool_eos, finished_first)[:, :beams]
  # An item that is done keeps its pool as it was: its result is then the
  # same however long the rest of its batch searches on.
  def kept(old, new):
    done = state.done.reshape(state.done.shape + (1,) * (new.ndim - 1))
    return jnp.where(done, old, new)
  finished_scores = kept(state.finished_scores,
                         _gather_beams(pool_scores, picks))
  return state.replace(
      finished_sequences=kept(state.finished_sequences,
                              _gather_beams(pool_sequences, picks)),
      finished_scores=finished_scores,
      finished_lengths=kept(state.finished_lengths,
                            _gather_beams(pool_lengths, picks)),
      finished_eos=kept(state.finished_eos, _gather_beams(pool_eos, picks)),
      done=state.done | (length >= state.limit) | _is_done(
          stopping, live_log_probs[:, 0], finished_scores, n_best, length,
          state.limit, alpha))


def _rank(scores, reached_eos, finished_first: bool):
  """Indices that order each row best first: float32[batch, n] scores,
  bool[batch, n] reached_eos -> int32[batch, n].

  By score, ties to the lower index (as lax.top_k); with finished_first,
  every hypothesis that reached eos first. An empty slot (score -inf) never
  counts as having reached eos.
  """
  first = (reached_eos & (scores > -jnp.inf) if finished_first
           else jnp.ones_like(reached_eos))
  indices = jnp.broadcast_to(jnp.arange(scores.shape[1], dtype=jnp.int32),
                             scores.shape)
  *_, order = jax.lax.sort((~first, -scores, indices), num_keys=2,
                           is_stable=True)
  return order


def take_items(state: BeamState, items) -> BeamState:
  """The search of batch items `items` (int32[k]) alone: [k, ...] fields.

  The cache keeps those items' beam rows; all items are at the same step.
  """
  beams = state.live_log_probs.shape[1]

  def take(leaf):
    by_item = leaf.reshape((-1, beams) + leaf.shape[1:])
    return by_item[items].reshape((-1,) + leaf.shape[1:])

  cache = _map_beam_rows(take, state.cache)
  return jax.tree.map(lambda leaf: leaf if leaf.ndim == 0 else leaf[items],
                      state.replace(cache=None)).replace(cache=cache)


def beam_search_result(state: BeamState, n_best: int = 1) -> BeamSearchResult:
  """The n_best finished hypotheses of each item, best first (see beam_search)."""
  return BeamSearchResult(
      sequences=state.finished_sequences[:, :n_best, 1:],
      scores=state.finished_scores[:, :n_best],
      lengths=state.finished_lengths[:, :n_best],
      reached_eos=state.finished_eos[:, :n_best])


def _cannot_improve(best_live_log_prob, finished_score, length, limit,
                    alpha: float):
  """True where no live hypothesis can still beat a finished score.

  A live hypothesis of log-probability x <= 0 can only lose probability, and
  will end with some length L in [length + 1, limit]. Its best possible score
  is max_L x / lp(L) = x / max_L lp(L), and lp is monotonic in L, so the max is
  at one of the two ends: L = limit for alpha >= 0, L = length + 1 for
  alpha < 0. With an empty finished slot (score -inf) this is False unless no
  live hypothesis is left either.

  best_live_log_prob, finished_score, limit (each item's): [batch] ->
  bool[batch].
  """
  largest_penalty = jnp.maximum(length_penalty(length + 1, alpha),
                                length_penalty(limit, alpha))
  return finished_score >= best_live_log_prob / largest_penalty


def _is_done(stopping: str, best_live_log_prob, finished_scores,
             n_best: int, length, limit, alpha: float):
  """Which items the `stopping` rule ends after this step: bool[batch].

  best_live_log_prob: float32[batch]; finished_scores: float32[batch, beams],
  best first (-inf: an empty slot); length: tokens generated so far; limit:
  int32[batch], each item's limit.
  """
  nth_finished = finished_scores[:, n_best - 1]
  exact = _cannot_improve(best_live_log_prob, nth_finished, length, limit,
                          alpha)
  if stopping == 'beam_finished':
    return exact | jnp.all(finished_scores > -jnp.inf, axis=1)
  if stopping == 'current_length':
    # The worst slot is -inf until beam_size hypotheses have finished, so
    # this also waits for a full set of finished ones, as Hugging Face does.
    return exact | (finished_scores[:, -1] >=
                    best_live_log_prob / length_penalty(length, alpha))
  return exact
