"""Decoding: what we feed in after training to get an output sentence.

The core is model-agnostic (as in T5X): a search takes a function
`tokens_to_logits(tokens, cache) -> (logits, new_cache)` and never looks
inside the model. The Transformer entry points below build that function from
params: the encoder runs once, then the decoder runs one token per step with
its key/value cache. Everything is a jax.lax loop, so the whole search runs on
the device and can be jitted, vmapped or sharded by the caller. A model
trained with scan_layers decodes with its layers unrolled (`model.unrolled`).

Neither search ever emits pad (the filler after eos) or bos (it only starts a
sequence); scores stay the model's own log-probabilities.
"""

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.masks import padding_mask
from flaxformer_mini.model import Transformer, unrolled

TokensToLogits = Callable[[jnp.ndarray, Any], tuple[jnp.ndarray, Any]]


def _forbid(scores, token_ids):
  """Sets scores[..., id] = -inf for each id: [..., vocab] -> [..., vocab]."""
  return scores.at[..., jnp.asarray(token_ids)].set(-jnp.inf)


def _argmax(scores):
  """jnp.argmax over the last axis, as two plain reductions: [..., n] -> int32[...].

  The first index of the maximum (or of the first NaN, as jnp.argmax), found
  by a max and then a min over the indices that reach it: XLA's CPU backend
  runs these 2.4-4x faster than argmax's reduction of (value, index) pairs,
  which took a thirteenth of a greedy step of `base` at batch 32.
  """
  best = jnp.max(scores, axis=-1, keepdims=True)
  indices = jnp.arange(scores.shape[-1], dtype=jnp.int32)
  hits = (scores == best) | jnp.isnan(scores)
  return jnp.min(jnp.where(hits, indices, scores.shape[-1]), axis=-1)


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
    logits = _forbid(logits.astype(jnp.float32), [pad_id, bos_id])
    next_token = _argmax(logits)  # [batch]
    next_token = jnp.where(finished, pad_id, next_token)
    tokens = jax.lax.dynamic_update_slice(tokens, next_token[:, None],
                                          (0, step + 1))
    return step + 1, tokens, cache, finished | (next_token == eos_id)

  _, tokens, _, _ = jax.lax.while_loop(
      not_done, one_token, (jnp.asarray(0), tokens, cache, finished))
  return tokens[:, 1:]


@flax.struct.dataclass
class BeamSearchResult:
  """The n best hypotheses of each batch item, best first.

  Attributes:
    sequences: int32[batch, n_best, max_len], tokens, eos if reached, then pad.
    scores: float32[batch, n_best], log p(sequence) / length_penalty(length).
    lengths: int32[batch, n_best], generated tokens, eos included.
    reached_eos: bool[batch, n_best]; False for a hypothesis that was cut at
      max_len without eos (scored the same way, with length max_len).
  """
  sequences: jnp.ndarray
  scores: jnp.ndarray
  lengths: jnp.ndarray
  reached_eos: jnp.ndarray


def length_penalty(length, alpha: float):
  """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha; a hypothesis scores log p / lp."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0)**alpha


def expand_to_beams(x, beam_size: int):
  """[batch, ...] -> [batch * beam, ...], each item repeated beam_size times."""
  return jnp.repeat(x, beam_size, axis=0)


def _gather_beams(x, beam_indices):
  """x: [batch, beams, ...], beam_indices: int32[batch, k] -> [batch, k, ...]."""
  return jax.vmap(lambda row, indices: row[indices])(x, beam_indices)


def _gather_cache(cache, beam_indices, batch_size: int):
  """Reorders every [batch * beams, ...] cache leaf to follow beam_indices.

  beam_indices: int32[batch, beams]. Scalar leaves (the position counters) are
  shared by all beams and stay as they are.
  """
  def gather(leaf):
    if leaf.ndim == 0:
      return leaf
    beams = leaf.reshape((batch_size, -1) + leaf.shape[1:])
    return _gather_beams(beams, beam_indices).reshape(leaf.shape)
  return jax.tree.map(gather, cache)


def beam_search(tokens_to_logits: TokensToLogits, cache, *, batch_size: int,
                beam_size: int, max_len: int, alpha: float, bos_id: int,
                eos_id: int, pad_id: int, n_best: int = 1,
                on_step: Callable | None = None) -> BeamSearchResult:
  """Beam search with a live and a finished pool, all in one lax.while_loop.

  Each step extends every live hypothesis by every token and keeps the top
  2 * beam_size candidates, so that hypotheses ending in eos never starve the
  live pool: the best beam_size candidates without eos stay live, and the eos
  candidates among the best beam_size enter the finished pool with score
  log p / length_penalty(length). On the last step the live hypotheses enter
  the finished pool too, flagged `reached_eos=False`, with the same scoring.
  The search stops early once no live hypothesis can still beat the worst
  finished one (see `_cannot_improve`).

  Args:
    tokens_to_logits: (int32[batch * beam, 1] last tokens, cache) ->
      (float[batch * beam, vocab] logits, new cache). log_softmax runs in
      float32 here whatever the model's dtype.
    cache: the decoder state for [batch, ...]; expanded over beams here
      (scalar leaves are shared by all beams).
    batch_size: number of batch items.
    beam_size: hypotheses kept per item.
    max_len: generated positions at most.
    alpha: length-penalty exponent (0 = raw log-probabilities).
    bos_id, eos_id, pad_id: first input token, end token, filler after eos.
    n_best: how many finished hypotheses to return per item (<= beam_size).
    on_step: for watching the search, e.g. in the notebook: called on the
      host (jax.debug.callback) at every step with (step, the candidates
      int32[batch, 2 * beam, max_len + 1] with bos in column 0, their
      log-probabilities float32[batch, 2 * beam], best first). None costs
      nothing.

  Returns:
    A BeamSearchResult with [batch, n_best, ...] fields, best first.
  """
  if not 1 <= n_best <= beam_size:
    raise ValueError(f'n_best={n_best}: must lie in [1, beam_size={beam_size}].')
  batch, beams = batch_size, beam_size
  cache = jax.tree.map(
      lambda x: x if x.ndim == 0 else expand_to_beams(x, beams), cache)
  # Column 0 holds bos; step i reads column i and writes column i + 1.
  sequences = jnp.full((batch, beams, max_len + 1), pad_id, jnp.int32)
  sequences = sequences.at[:, :, 0].set(bos_id)
  # Only beam 0 is alive at first, so the first step does not pick the same
  # token in every beam.
  live_log_probs = jnp.tile(
      jnp.array([0.0] + [-jnp.inf] * (beams - 1), jnp.float32), (batch, 1))
  state = dict(
      step=jnp.asarray(0, jnp.int32),
      live_sequences=sequences,                          # [batch, beams, max_len + 1]
      live_log_probs=live_log_probs,                     # [batch, beams]
      cache=cache,                                       # [batch * beams, ...]
      finished_sequences=sequences,                      # [batch, beams, max_len + 1]
      finished_scores=jnp.full((batch, beams), -jnp.inf),  # -inf: empty slot
      finished_lengths=jnp.zeros((batch, beams), jnp.int32),
      finished_eos=jnp.zeros((batch, beams), bool),
      done=jnp.zeros((batch,), bool))

  def keep_going(state):
    return (state['step'] < max_len) & ~jnp.all(state['done'])

  def one_step(state):
    step = state['step']
    length = step + 1  # generated tokens after this step, eos included
    last = jax.lax.dynamic_slice_in_dim(state['live_sequences'], step, 1,
                                        axis=2)  # [batch, beams, 1]
    logits, cache = tokens_to_logits(last.reshape(batch * beams, 1),
                                     state['cache'])  # [batch * beams, vocab]
    vocab = logits.shape[-1]
    log_probs = _forbid(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1),
                        [pad_id, bos_id])
    candidates = (state['live_log_probs'][:, :, None] +
                  log_probs.reshape(batch, beams, vocab))  # [batch, beams, vocab]
    # One top-k over beams x vocab: measured faster on CPU than a top-k per
    # beam followed by one over beams (benchmarks/levers.py).
    top_log_probs, top_indices = jax.lax.top_k(
        candidates.reshape(batch, beams * vocab), 2 * beams)  # [batch, 2 * beams]
    top_beams = top_indices // vocab
    top_tokens = (top_indices % vocab).astype(jnp.int32)
    top_sequences = jax.lax.dynamic_update_slice(
        _gather_beams(state['live_sequences'], top_beams),
        top_tokens[:, :, None], (0, 0, step + 1))  # [batch, 2 * beams, max_len + 1]
    is_eos = top_tokens == eos_id
    if on_step is not None:
      jax.debug.callback(on_step, step, top_sequences, top_log_probs)

    # The live pool: the best `beams` candidates that did not just end.
    live_log_probs, live_picks = jax.lax.top_k(
        jnp.where(is_eos, -jnp.inf, top_log_probs), beams)  # [batch, beams]
    live_sequences = _gather_beams(top_sequences, live_picks)
    cache = _gather_cache(cache, _gather_beams(top_beams, live_picks), batch)

    # The finished pool: its old members, the eos candidates that made the
    # top `beams`, and on the last step every live hypothesis (no eos).
    made_beam = jnp.arange(2 * beams) < beams
    eos_scores = jnp.where(is_eos & made_beam, top_log_probs, -jnp.inf
                          ) / length_penalty(length, alpha)
    last_step = length == max_len
    cut_scores = jnp.where(last_step, live_log_probs, -jnp.inf
                          ) / length_penalty(length, alpha)
    pool_scores = jnp.concatenate(
        [state['finished_scores'], eos_scores, cut_scores], axis=1)  # [batch, 4 * beams]
    pool_sequences = jnp.concatenate(
        [state['finished_sequences'], top_sequences, live_sequences], axis=1)
    pool_lengths = jnp.concatenate(
        [state['finished_lengths'],
         jnp.full((batch, 3 * beams), length, jnp.int32)], axis=1)
    pool_eos = jnp.concatenate(
        [state['finished_eos'], jnp.ones((batch, 2 * beams), bool),
         jnp.zeros((batch, beams), bool)], axis=1)
    finished_scores, finished_picks = jax.lax.top_k(pool_scores, beams)
    done = _cannot_improve(live_log_probs[:, 0], finished_scores[:, -1],
                           length, max_len, alpha)
    return dict(
        step=step + 1,
        live_sequences=live_sequences,
        live_log_probs=live_log_probs,
        cache=cache,
        finished_sequences=_gather_beams(pool_sequences, finished_picks),
        finished_scores=finished_scores,
        finished_lengths=_gather_beams(pool_lengths, finished_picks),
        finished_eos=_gather_beams(pool_eos, finished_picks),
        done=done)

  state = jax.lax.while_loop(keep_going, one_step, state)
  return BeamSearchResult(
      sequences=state['finished_sequences'][:, :n_best, 1:],
      scores=state['finished_scores'][:, :n_best],
      lengths=state['finished_lengths'][:, :n_best],
      reached_eos=state['finished_eos'][:, :n_best])


def _cannot_improve(best_live_log_prob, worst_finished_score, length,
                    max_len: int, alpha: float):
  """True where no live hypothesis can still beat the worst finished one.

  A live hypothesis of log-probability x <= 0 can only lose probability, and
  will end with some length L in [length + 1, max_len]. Its best possible score
  is max_L x / lp(L) = x / max_L lp(L), and lp is monotonic in L, so the max is
  at one of the two ends: L = max_len for alpha >= 0, L = length + 1 for
  alpha < 0. With an empty finished slot (score -inf) this is False unless no
  live hypothesis is left either.

  best_live_log_prob, worst_finished_score: float32[batch] -> bool[batch].
  """
  largest_penalty = jnp.maximum(length_penalty(length + 1, alpha),
                                length_penalty(max_len, alpha))
  return worst_finished_score >= best_live_log_prob / largest_penalty


def init_cache(config: TransformerConfig, encoded, src_mask, max_len: int):
  """An all-zero key/value cache for `max_len` decoder steps.

  encoded: [batch, src_len, d_model] -> a pytree of [batch, heads, max_len,
  d_k] keys and values per decoder layer, plus the position counters.
  """
  model = Transformer(unrolled(None, config)[1])
  dummy = jnp.zeros((encoded.shape[0], max_len), jnp.int32)
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.key(0), encoded, src_mask, dummy,
                         decode=True, method=Transformer.decode))['cache']
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def project_memory(params, config: TransformerConfig, encoded, src_mask):
  """Every decoder layer's cross-attention keys and values of `encoded`.

  The encoder output is fixed for the whole search, so its projections W^K,
  W^V are computed once here, not at every step. -> the 'memory' collection:
  per layer key and value [batch, heads, src_len, d_k].
  """
  params, config = unrolled(params, config)
  first = jnp.full((encoded.shape[0], 1), config.bos_id, jnp.int32)
  _, variables = Transformer(config).apply(
      {'params': params}, encoded, src_mask, first, decode=True,
      mutable=['cache', 'memory'], method=Transformer.decode)
  return variables['memory']


def transformer_tokens_to_logits(params, config: TransformerConfig, encoded,
                                 src_mask) -> TokensToLogits:
  """The decoder of Transformer(config) as a one-step function with cache.

  encoded: [batch, src_len, d_model] and src_mask: bool[batch, 1, 1, src_len]
  are fixed for the whole search (the encoder ran once, and the cross-
  attention keys and values are projected once, by `project_memory`). The
  function takes tokens for batch * beams rows (the beams of a sentence
  consecutive, as `expand_to_beams` lays them out), which share their
  sentence's encoder output.
  """
  params, config = unrolled(params, config)
  model = Transformer(config)
  memory = project_memory(params, config, encoded, src_mask)

  def tokens_to_logits(tokens, cache):
    logits, variables = model.apply(
        {'params': params, 'cache': cache, 'memory': memory}, encoded,
        src_mask, tokens, decode=True, mutable=['cache'],
        method=Transformer.decode)
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
  tokens_to_logits, cache = _encoded_for_search(params, src, config, max_len)
  return greedy_search(tokens_to_logits, cache, src.shape[0], max_len,
                       config.bos_id, config.eos_id, config.pad_id)


def _encoded_for_search(params, src, config: TransformerConfig, max_len: int):
  """What a search needs from Transformer(config) for the sources src.

  src: int32[batch, src_len]. Runs the encoder once (a scan_layers model
  with its layers unrolled) -> (tokens_to_logits for its decoder, the empty
  cache for max_len steps).
  """
  check_max_len(config, max_len)
  params, config = unrolled(params, config)
  src_mask = padding_mask(src, config.pad_id)
  encoded = Transformer(config).apply({'params': params}, src, src_mask,
                                      method=Transformer.encode)
  return (transformer_tokens_to_logits(params, config, encoded, src_mask),
          init_cache(config, encoded, src_mask, max_len))


def default_max_len(config: TransformerConfig, src_len: int) -> int:
  """The paper's limit, input length + 50, within the positional table."""
  return min(src_len + 50, config.max_len)


def beam_decode(params, src, config: TransformerConfig, beam_size: int = 4,
                alpha: float = 0.6, max_len: int | None = None,
                n_best: int = 1, on_step: Callable | None = None
                ) -> BeamSearchResult:
  """Beam search translation of a batch with Transformer(config) and `params`.

  The encoder runs once, and its keys and values for the cross-attention are
  projected once per sentence and shared by its beams; the decoder runs one
  token per step with its key/value cache, reordered with the surviving
  beams. The paper's settings are the defaults: beam 4,
  alpha 0.6, max_len = source length + 50.

  Args:
    params: the model parameters.
    src: int32[batch, src_len], pad-filled source ids.
    config: the model's config.
    beam_size, alpha, max_len, n_best, on_step: see `beam_search`.
    Under jax.jit, config, beam_size, alpha, max_len and n_best are static.

  Returns:
    BeamSearchResult: sequences int32[batch, n_best, max_len], scores,
    lengths and reached_eos [batch, n_best].
  """
  max_len = default_max_len(config, src.shape[1]) if max_len is None else max_len
  tokens_to_logits, cache = _encoded_for_search(params, src, config, max_len)
  return beam_search(
      tokens_to_logits, cache, batch_size=src.shape[0], beam_size=beam_size,
      max_len=max_len, alpha=alpha, bos_id=config.bos_id,
      eos_id=config.eos_id, pad_id=config.pad_id, n_best=n_best,
      on_step=on_step)
