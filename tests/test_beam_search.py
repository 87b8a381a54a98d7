import dataclasses
import functools
import itertools
import json
import math
import os
import pickle
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_mini import decoding, search, translation
from flaxformer_mini.data import copy_task
from flaxformer_mini.masks import padding_mask, target_mask
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_beam_size_one_is_greedy(toy_model):
  cfg, params, src = toy_model
  greedy = decoding.greedy_decode(params, src, cfg, max_len=10)
  beam = decoding.beam_decode(params, src, cfg, beam_size=1, alpha=0.0,
                              max_len=10)
  assert beam.sequences.shape == (4, 1, 10)
  np.testing.assert_array_equal(beam.sequences[:, 0], greedy)


def test_on_step_shows_what_each_step_feeds_and_finishes_under_jit(
    toy_model):
  cfg, params, src = toy_model
  seen = []
  result = jax.jit(functools.partial(
      decoding.beam_decode, config=cfg, beam_size=2, alpha=0.0, max_len=6,
      on_step=seen.append))(params, src)
  jax.effects_barrier()
  steps = [int(state.step) for state in seen]
  assert steps == list(range(1, len(seen) + 1)) and 1 <= len(seen) <= 6
  for state in seen:
    step = int(state.step)
    assert state.cache is None  # left out of what the host sees
    live = np.asarray(state.live_sequences)
    assert live.shape == (4, 2, 7)
    assert np.all(live[:, :, 0] == cfg.bos_id)  # what is fed: bos, then tokens
    assert np.all(live[:, :, step + 1:] == cfg.pad_id)
    assert np.all(np.diff(np.asarray(state.live_log_probs), axis=1) <= 0)
  last = seen[-1]
  np.testing.assert_array_equal(last.finished_sequences[:, :1, 1:],
                                result.sequences)
  np.testing.assert_array_equal(last.finished_scores[:, :1], result.scores)


def test_hypotheses_end_at_eos_are_padded_after_it_and_respect_max_len(toy_model):
  cfg, params, src = toy_model
  result = decoding.beam_decode(params, src, cfg, beam_size=4, alpha=0.6,
                                max_len=7, n_best=4)
  assert result.sequences.shape == (4, 4, 7)
  sequences = np.asarray(result.sequences)
  lengths = np.asarray(result.lengths)
  reached_eos = np.asarray(result.reached_eos)
  scores = np.asarray(result.scores)
  assert np.all(np.diff(scores, axis=1) <= 0)  # best first
  for b, k in itertools.product(range(4), range(4)):
    row, length = sequences[b, k], lengths[b, k]
    assert 1 <= length <= 7
    assert np.all(row[length:] == cfg.pad_id)  # never extended after eos
    assert cfg.eos_id not in row[:length - 1]
    assert cfg.pad_id not in row[:length] and cfg.bos_id not in row[:length]
    assert (row[length - 1] == cfg.eos_id) == reached_eos[b, k]
    if not reached_eos[b, k]:
      assert length == 7


def _score_exhaustively(cfg, params, src, max_len, alpha, finished_first):
  """Every output sequence of one source, scored by the full model, best first.

  Sequences are eos-terminated of length <= max_len, or of length max_len
  without eos (cut); tokens are anything but pad and bos. Ranked by
  (reached eos, score) with finished_first, by score alone without.
  Returns [(reached_eos, score, tokens)].
  """
  ordinary = [t for t in range(cfg.tgt_vocab_size)
              if t not in (cfg.pad_id, cfg.bos_id, cfg.eos_id)]
  candidates = []
  for length in range(1, max_len + 1):
    for body in itertools.product(ordinary, repeat=length - 1):
      candidates.append(body + (cfg.eos_id,))
      if length == max_len:
        candidates.extend(body + (t,) for t in ordinary)
  tgt_in = np.full((len(candidates), max_len), cfg.pad_id)
  tgt_out = np.full((len(candidates), max_len), cfg.pad_id)
  for i, tokens in enumerate(candidates):
    tgt_in[i, :len(tokens)] = (cfg.bos_id,) + tokens[:-1]
    tgt_out[i, :len(tokens)] = tokens
  srcs = jnp.repeat(src[None], len(candidates), axis=0)
  logits = Transformer(cfg).apply(
      {'params': params}, srcs, jnp.asarray(tgt_in),
      padding_mask(srcs, cfg.pad_id), target_mask(jnp.asarray(tgt_in),
                                                   cfg.pad_id))
  log_probs = np.asarray(jax.nn.log_softmax(logits))
  token_log_probs = np.take_along_axis(log_probs, tgt_out[..., None], -1)[..., 0]
  totals = np.sum(np.where(tgt_out != cfg.pad_id, token_log_probs, 0.0), -1)
  lengths = np.array([len(tokens) for tokens in candidates])
  scores = totals / ((5.0 + lengths) / 6.0)**alpha
  ranked = [(tokens[-1] == cfg.eos_id, float(score), tokens)
            for score, tokens in zip(scores, candidates)]
  return sorted(ranked, key=lambda r: (-r[0] if finished_first else 0, -r[1]))


@pytest.mark.parametrize('finished_first', [True, False])
@pytest.mark.parametrize('alpha', [-0.5, 0.0, 0.6, 2.0])
def test_enough_beams_find_the_exhaustive_best(toy_config, alpha,
                                               finished_first):
  # Under each ranking rule: finished_first (the default: every hypothesis
  # that reached eos before any cut at max_len) and by score alone.
  # 4 ordinary tokens + eos, 3 positions: 85 candidate sequences per source.
  cfg = toy_config.replace(src_vocab_size=7, tgt_vocab_size=7)
  params = init_params(cfg, jax.random.key(5))
  src = jnp.array([[3, 4, 5], [6, 5, cfg.pad_id]], jnp.int32)
  max_len, n_best = 3, 5
  # 16 live prefixes x 5 tokens = 80 candidates: 80 beams see them all.
  wide, narrow = (decoding.beam_decode(
      params, src, cfg, beam_size=beams, alpha=alpha, max_len=max_len,
      n_best=n, finished_first=finished_first)
                  for beams, n in ((80, n_best), (2, 1)))
  for b in range(2):
    truth = _score_exhaustively(cfg, params, src[b], max_len, alpha,
                                finished_first)
    for k in range(n_best):
      reached_eos, score, tokens = truth[k]
      np.testing.assert_allclose(wide.scores[b, k], score, rtol=1e-4)
      assert bool(wide.reached_eos[b, k]) == reached_eos
      length = int(wide.lengths[b, k])
      assert tuple(np.asarray(wide.sequences[b, k, :length])) == tokens
    # The narrow search's best never outranks the exhaustive best.
    best = (bool(narrow.reached_eos[b, 0]), float(narrow.scores[b, 0]))
    if finished_first:
      assert best <= (truth[0][0], truth[0][1] + 1e-5)
    else:
      assert best[1] <= truth[0][1] + 1e-5


def _markov_search(alpha, beam_size, max_len=4, **options):
  """A hand-made Markov chain over pad, bos, eos, a, b (as in T5X's tests).

  From bos: eos 0.45, a 0.5, b 0.05. From a: eos 0.7, a 0.2, b 0.1.
  From b: eos 0.1, a 0.1, b 0.8. Best sequences:
    alpha = 0: [eos] (log 0.45 = -0.80) beats [a, eos] (log 0.35 = -1.05);
    alpha = 2: [a, eos] scores -1.05 / (7/6)^2 = -0.77, beating [eos] at
    -0.80 / 1 and everything longer.
  """
  pad, bos, eos, a, b = range(5)
  probs = np.zeros((5, 5))
  probs[bos, [eos, a, b]] = [0.45, 0.5, 0.05]
  probs[a, [eos, a, b]] = [0.7, 0.2, 0.1]
  probs[b, [eos, a, b]] = [0.1, 0.1, 0.8]
  with np.errstate(divide='ignore'):
    transition_logits = jnp.asarray(np.log(probs), jnp.float32)

  def tokens_to_logits(tokens, cache):
    return transition_logits[tokens[:, 0]], cache

  return search.beam_search(
      tokens_to_logits, jnp.zeros((1,)), batch_size=1, beam_size=beam_size,
      max_len=max_len, alpha=alpha, bos_id=bos, eos_id=eos, pad_id=pad,
      **options)


@pytest.mark.parametrize('beam_size', [2, 4])
def test_markov_chain_best_sequence_depends_on_alpha_as_computed(beam_size):
  short = _markov_search(alpha=0.0, beam_size=beam_size)
  np.testing.assert_array_equal(short.sequences[0, 0], [2, 0, 0, 0])
  np.testing.assert_allclose(short.scores[0, 0], np.log(0.45), rtol=1e-6)
  long = _markov_search(alpha=2.0, beam_size=beam_size)
  np.testing.assert_array_equal(long.sequences[0, 0], [3, 2, 0, 0])
  np.testing.assert_allclose(long.scores[0, 0],
                             np.log(0.35) / (7 / 6)**2, rtol=1e-6)
  assert bool(long.reached_eos[0, 0]) and int(long.lengths[0, 0]) == 2


def test_a_hypothesis_that_reached_eos_outranks_a_cut_one_by_default():
  # One step: [eos] (p 0.45, finished) against [a] (p 0.5, cut at max_len).
  finished = _markov_search(alpha=0.0, beam_size=2, max_len=1)
  np.testing.assert_array_equal(finished.sequences[0, 0], [2])
  assert bool(finished.reached_eos[0, 0])
  np.testing.assert_allclose(finished.scores[0, 0], np.log(0.45), rtol=1e-6)
  by_score = _markov_search(alpha=0.0, beam_size=2, max_len=1,
                            finished_first=False)
  np.testing.assert_array_equal(by_score.sequences[0, 0], [3])
  assert not bool(by_score.reached_eos[0, 0])
  np.testing.assert_allclose(by_score.scores[0, 0], np.log(0.5), rtol=1e-6)


def _countdown_search_pieces():
  """A model that ends item i after about its own number of steps.

  The cache holds each row's steps left; until they run out eos is unlikely,
  after that likely, so the items of one batch end at different steps.
  """
  pad, bos, eos = range(3)
  with np.errstate(divide='ignore'):
    before = jnp.log(jnp.array([0, 0, 0.05, 0.5, 0.3, 0.15], jnp.float32))
    after = jnp.log(jnp.array([0, 0, 0.9, 0.05, 0.03, 0.02], jnp.float32))

  def tokens_to_logits(tokens, cache):
    del tokens
    logits = jnp.where(cache['left'][:, None] > 0, before, after)
    return logits, {'left': cache['left'] - 1}

  ids = dict(bos_id=bos, eos_id=eos, pad_id=pad)
  return tokens_to_logits, ids


def test_finished_items_can_leave_the_search_without_changing_any_result():
  tokens_to_logits, ids = _countdown_search_pieces()
  left = jnp.array([1, 6, 2, 9, 0, 4, 3, 7], jnp.int32)
  start = lambda: search.start_beam_search(
      {'left': left}, batch_size=8, beam_size=3, max_len=14, bos_id=ids['bos_id'],
      pad_id=ids['pad_id'])
  whole = search.beam_search_result(search.run_beam_search(
      tokens_to_logits, start(), alpha=0.6, **ids), n_best=3)

  part = search.run_beam_search(tokens_to_logits, start(), alpha=0.6,
                                until_searching=3, **ids)
  not_done = np.flatnonzero(~np.asarray(part.done))
  assert len(not_done) <= 3 and int(part.step) < 14  # stopped on the way
  done = np.flatnonzero(np.asarray(part.done))
  early = search.beam_search_result(part, n_best=3)
  rest = search.beam_search_result(search.run_beam_search(
      tokens_to_logits, search.take_items(part, jnp.asarray(not_done)),
      alpha=0.6, **ids), n_best=3)
  for field in ('sequences', 'scores', 'lengths', 'reached_eos'):
    np.testing.assert_array_equal(getattr(early, field)[done],
                                  getattr(whole, field)[done])
    np.testing.assert_array_equal(getattr(rest, field),
                                  getattr(whole, field)[not_done])
  lengths = np.asarray(whole.lengths[:, 0])
  assert len(set(lengths.tolist())) > 3  # the items did end apart


def _history_search_pieces():
  """A model that reads its whole history, and how to window its cache.

  The cache keeps every token fed at its position (int32[rows, max_len])
  and each row's position; a row's next-token distribution depends on its
  item and the sum of all the tokens it was fed, and eos grows likelier
  with length. A
  window that lost, misplaced or failed to reorder a position changes what
  the search finds.
  """
  pad, bos, eos = range(3)
  table = jax.random.normal(jax.random.key(3), (7, 8))

  def tokens_to_logits(tokens, cache):
    position = cache['position']
    history = jax.vmap(lambda row, token, at: row.at[at].set(token))(
        cache['history'], tokens[:, 0], position)
    logits = table[(history.sum(1) + cache['item']) % 7].at[:, eos].add(
        0.4 * position - 3)
    return logits, {**cache, 'history': history, 'position': position + 1}

  windows = search.CacheWindows(
      lengths=(2, 4, 8),
      take=lambda cache, length: {**cache,
                                  'history': cache['history'][:, :length]},
      put=lambda cache, window: {**window, 'history': (
          jax.lax.dynamic_update_slice_in_dim(
              cache['history'], window['history'], 0, axis=1))})
  cache = {'history': jnp.zeros((8, 12), jnp.int32),
           'position': jnp.zeros((8,), jnp.int32),
           'item': jnp.arange(8, dtype=jnp.int32)}
  return tokens_to_logits, windows, cache, dict(bos_id=bos, eos_id=eos,
                                                pad_id=pad)


def _history_search_start(cache, ids):
  """The history model's search of its 8 items, 3 beams, up to 12 tokens,
  before its first step."""
  return search.start_beam_search(
      cache, batch_size=8, beam_size=3, max_len=12, bos_id=ids['bos_id'],
      pad_id=ids['pad_id'])


def test_a_cache_grown_in_windows_gives_the_same_search_and_cache():
  tokens_to_logits, windows, cache, ids = _history_search_pieces()
  start = lambda: _history_search_start(cache, ids)
  run = lambda state, **kwargs: search.run_beam_search(
      tokens_to_logits, state, alpha=0.6, n_best=3, **ids, **kwargs)
  whole = run(start())
  windowed = jax.jit(lambda state: run(state, windows=windows))(start())
  jax.tree.map(np.testing.assert_array_equal, windowed, whole)  # cache too
  assert int(whole.step) > 8  # steps in every window and past the last
  assert len(set(np.asarray(whole.finished_lengths[:, 0]).tolist())) > 3

  # A search stopped on the way and narrowed goes on in the window of its
  # step, and ends as the whole search did.
  part = run(start(), until_searching=4, windows=windows)
  assert 2 < int(part.step) < 12
  searching = np.flatnonzero(~np.asarray(part.done))
  rest = run(search.take_items(part, jnp.asarray(searching)), windows=windows)
  jax.tree.map(np.testing.assert_array_equal, rest,
               search.take_items(whole, jnp.asarray(searching)))

  # Stopped at its last window's end instead (past_windows=False: one loop
  # body less to compile), it goes on from there as the whole search did.
  stopped = run(start(), windows=windows, past_windows=False)
  assert int(stopped.step) == 8 and not np.asarray(stopped.done).all()
  jax.tree.map(np.testing.assert_array_equal,
               run(stopped, windows=windows), whole)
  # Without a window shorter than max_len, it steps over the whole cache.
  short = dataclasses.replace(windows, lengths=(12,))
  jax.tree.map(np.testing.assert_array_equal,
               run(start(), windows=short, past_windows=False), whole)


def test_a_window_that_runs_no_step_is_never_copied():
  # Taking a window out of the cache and putting it back is a copy of the
  # whole window: a window the search stops before, or has passed, must
  # not cost it (most first stages of the translate command end in the
  # first window).
  tokens_to_logits, windows, cache, ids = _history_search_pieces()
  taken = []
  record = lambda length: taken.append(int(length))

  def take(cache, length, take=windows.take):
    jax.debug.callback(record, length, ordered=True)
    return take(cache, length)

  # Under the exact rule this model's first item is done at step 8, all but
  # three at step 9.
  windows = dataclasses.replace(windows, lengths=(9, 10), take=take)
  start = lambda: _history_search_start(cache, ids)
  run = jax.jit(lambda state, until: search.run_beam_search(
      tokens_to_logits, state, alpha=0.6, n_best=3, until_searching=until,
      windows=windows, stopping='exact', **ids), static_argnums=1)
  early = run(start(), 7)
  assert int(early.step) == 8 and taken == [9]  # window 10 never reached
  taken.clear()
  part = run(start(), 3)
  assert int(part.step) == 9 and taken == [9]
  taken.clear()
  whole = run(part, 0)
  assert int(whole.step) == 11 and taken == [10]  # window 9 behind it


def test_each_batch_is_queued_before_the_one_before_it_waits():
  """translate_ids' batches: the next batch's first program is called before
  the host waits on the stages of the batch before it (the devices search
  on meanwhile), and the results come back in order, a batch searched
  without a program to wait on included."""
  events = []

  def batch(name, stages):
    for stage in range(stages):
      events.append(f'{name} calls stage {stage}')
      yield
    return name.upper()

  batches = [('a', batch('a', 2)), ('b', batch('b', 2)), ('c', batch('c', 0)),
             ('d', batch('d', 1))]
  for members, result in translation._one_batch_ahead(batches):  # pylint: disable=protected-access
    events.append(f'{members}: {result}')
  assert events == ['a calls stage 0', 'b calls stage 0', 'a calls stage 1',
                    'a: A', 'b calls stage 1', 'b: B', 'd calls stage 0',
                    'c: C', 'd: D']


def _in_slots(tokens_to_logits, items, *, slots, fill_rows, max_len, ids,
              **search_args):
  """Each item's best hypothesis, searched in `slots` slots refilled as
  items end (translation.search_in_slots): items: int32[count], each its
  own item of the history model. -> (int32[count, max_len], the number of
  slots searching at each refill)."""
  def slot_tokens_to_logits(tokens, cache, context):
    # The context is one row per slot, for all of its beams.
    item = search.expand_to_beams(context['item'], 3)
    logits, cache = tokens_to_logits(tokens, {**cache, 'item': item})
    return logits, {'history': cache['history'], 'position': cache['position']}

  item_cache = lambda k: {'history': jnp.zeros((k, max_len), jnp.int32),
                          'position': jnp.zeros((k,), jnp.int32)}
  state = search.start_slots(
      item_cache(slots), {'item': jnp.zeros((slots,), jnp.int32)},
      slots=slots, beam_size=3, max_len=max_len, bos_id=ids['bos_id'],
      pad_id=ids['pad_id'])
  fill = jax.jit(lambda state, slot_ids, new: search.fill_slots(
      state, slot_ids, item_cache(fill_rows), {'item': new},
      bos_id=ids['bos_id'], pad_id=ids['pad_id']))
  run = jax.jit(lambda state, until: search.run_slots(
      slot_tokens_to_logits, state, until_done=until, alpha=0.6, **ids,
      **search_args))
  searching = []

  def fill_some(slot_ids, rows):
    nonlocal state
    searching.append(int(np.sum(~np.asarray(state.done))))
    state = fill(state, slot_ids, jnp.asarray(items)[rows])

  def advance(until):
    nonlocal state
    state = run(state, until)
    return (np.asarray(state.done),
            np.asarray(state.finished_sequences)[:, 0, 1:])

  best = translation.search_in_slots(fill_some, advance, len(items), slots,
                                     fill_rows)
  return best, searching


@pytest.mark.parametrize('stopping', search.STOPPING_RULES)
def test_items_searched_in_refilled_slots_find_what_each_finds_alone(
    stopping):
  """Slots at different steps, refilled while the others search on: each
  item's result is bit for bit its search alone, in the order given."""
  tokens_to_logits, _, _, ids = _history_search_pieces()
  items = np.array([5, 0, 3, 6, 1, 4, 2, 6, 0, 5, 3], np.int32)
  best, searching = _in_slots(tokens_to_logits, items, slots=3, fill_rows=2,
                              max_len=12, ids=ids, stopping=stopping)
  assert any(0 < n < 3 for n in searching)  # filled while others searched
  for row, item in enumerate(items):
    alone = search.beam_search(
        tokens_to_logits, {'history': jnp.zeros((1, 12), jnp.int32),
                           'position': jnp.zeros((1,), jnp.int32),
                           'item': jnp.array([item])},
        batch_size=1, beam_size=3, max_len=12, alpha=0.6, stopping=stopping,
        **ids)
    np.testing.assert_array_equal(best[row], alone.sequences[0, 0])


def test_run_slots_refuses_to_wait_for_more_slots_than_it_has():
  tokens_to_logits, _, _, ids = _history_search_pieces()
  with pytest.raises(ValueError, match=r'^until_done=4: must lie in '
                     r'\[0, slots=3\]\.$'):
    search.run_slots(
        lambda tokens, cache, context: tokens_to_logits(tokens, cache),
        search.start_slots(
            {'history': jnp.zeros((3, 6), jnp.int32),
             'position': jnp.zeros((3,), jnp.int32),
             'item': jnp.zeros((3,), jnp.int32)}, {}, slots=3, beam_size=2,
            max_len=6, bos_id=ids['bos_id'], pad_id=ids['pad_id']),
        until_done=4, alpha=0.6, **ids)


@pytest.mark.parametrize('rows, n, k', [
    (3, 40_000, 8), (5, 10_007, 8), (2, 1_000, 3), (4, 30, 8)])
def test_top_k_in_blocks_is_top_k_ties_and_minus_infinity_included(rows, n, k):
  rng = np.random.default_rng(n)
  # Whole numbers: ties among the best, across blocks whose maxima differ;
  # a tenth -inf (forbidden tokens); one row almost all -inf, so that the
  # padding's -inf competes with real ones.
  x = np.round(rng.normal(size=(rows, n)) * 3).astype(np.float32)
  x[rng.random((rows, n)) < 0.1] = -np.inf
  x[0, 1:] = -np.inf
  values, indices = jax.jit(search.top_k_in_blocks, static_argnums=1)(x, k)
  expected_values, expected_indices = jax.lax.top_k(x, k)
  np.testing.assert_array_equal(values, expected_values)
  np.testing.assert_array_equal(indices, expected_indices)


@pytest.mark.parametrize('rows, groups, n, k', [
    (3, 4, 10_000, 8), (2, 3, 1_001, 6), (2, 5, 7, 4)])
def test_top_k_in_blocks_with_offsets_is_top_k_of_the_sums(rows, groups, n,
                                                           k):
  # A beam step's candidates: each beam's logits plus its own offset, ties
  # among the sums across beams and blocks, a dead beam (-inf offset).
  rng = np.random.default_rng(n)
  x = np.round(rng.normal(size=(rows, groups, n)) * 3).astype(np.float32)
  x[rng.random((rows, groups, n)) < 0.1] = -np.inf
  offsets = np.round(rng.normal(size=(rows, groups))).astype(np.float32)
  offsets[0, 1:] = -np.inf
  values, indices = jax.jit(search.top_k_in_blocks, static_argnums=1)(
      x, k, offsets)
  expected_values, expected_indices = jax.lax.top_k(
      (x + offsets[..., None]).reshape(rows, groups * n), k)
  np.testing.assert_array_equal(values, expected_values)
  np.testing.assert_array_equal(indices, expected_indices)


@pytest.mark.parametrize('rows, groups, n, k, forbidden', [
    (3, 4, 10_000, 8, (0, 2)),  # pad and bos of one block
    (2, 3, 1_001, 6, (5, 31, 1_000)),  # three blocks, the last one padded
    (2, 5, 7, 4, (1,)),  # too few blocks: lax.top_k
    (2, 4, 600, 8, ())])
def test_a_beam_steps_best_extensions_leave_out_forbidden_tokens(
    rows, groups, n, k, forbidden):
  """best_extensions: the top k of each beam's log p plus its logits'
  log_softmax over every beam's vocabulary, the forbidden tokens never
  taken; bitwise what the search took before, the forbidden tokens written
  over with -inf in a copy of the logits and the normalizer's maximum
  taken over them."""
  rng = np.random.default_rng(n)
  # Ties among the best across beams and blocks; the best logit of a row
  # on a forbidden token; a dead beam (-inf log p).
  logits = np.round(rng.normal(size=(rows, groups, n)) * 3).astype(np.float32)
  logits[:, :, list(forbidden)] = 20.0
  log_probs = np.round(rng.normal(size=(rows, groups))).astype(np.float32)
  log_probs[0, 1:] = -np.inf
  values, indices = jax.jit(search.best_extensions, static_argnums=(2, 3))(
      logits, log_probs, k, forbidden)
  written_over = logits.copy()
  written_over[:, :, list(forbidden)] = -np.inf
  offsets = log_probs - jax.nn.logsumexp(logits, axis=-1)
  before_values, before_indices = search.top_k_in_blocks(
      written_over, k, offsets)
  np.testing.assert_array_equal(values, before_values)
  np.testing.assert_array_equal(indices, before_indices)
  expected_values, expected_indices = jax.lax.top_k(
      (written_over + np.asarray(offsets)[..., None]).reshape(rows, -1), k)
  np.testing.assert_array_equal(indices, expected_indices)
  np.testing.assert_array_equal(values, expected_values)
  assert not np.isin(indices % n, forbidden).any()
  # top_k_in_blocks leaves them out the same way.
  np.testing.assert_array_equal(
      search.top_k_in_blocks(logits, k, offsets, forbidden)[1], indices)


def test_a_beam_steps_best_extensions_read_the_logits_in_two_reductions():
  """Compiled, best_extensions reduces the whole logits twice: the blocks'
  maxima and the normalizer's sum. The normalizer's maximum comes from the
  blocks' maxima; XLA used to merge those two maxima into one reduction
  over the logits again (a pass that cost 1.6 µs of a 103 µs row-step)."""
  rows, beams, vocab = 8, 4, 1000
  compiled = jax.jit(search.best_extensions, static_argnums=(2, 3)).lower(
      jnp.zeros((rows, beams, vocab)), jnp.zeros((rows, beams)), 8,
      (0, 1)).compile().as_text()
  shapes = dict(re.findall(r'%([\w.\-]+) = \w+\[([\d,]*)\]', compiled))
  sizes = [math.prod(int(d) for d in shapes[operand].split(',') if d)
           for operand in re.findall(r' reduce(?:-window)?\(%([\w.\-]+)',
                                     compiled)]
  assert sum(size >= rows * beams * vocab for size in sizes) == 2, compiled


def test_windows_double_up_to_three_quarters_of_max_len():
  assert search.doubling_windows(30) == ()
  assert search.doubling_windows(66) == search.doubling_windows(98) == (24, 48)
  assert search.doubling_windows(256) == (24, 48, 96, 192)


def test_the_transformers_cache_windows_leave_search_and_cache_unchanged(
    toy_model):
  cfg, params, src = toy_model
  tokens_to_logits, cache = decoding.encoded_for_search(params, src, cfg, 64)
  assert decoding.cache_windows(64).lengths == (24, 48)
  run = jax.jit(lambda windows: search.run_beam_search(
      tokens_to_logits, search.start_beam_search(
          cache, batch_size=4, beam_size=2, max_len=64, bos_id=cfg.bos_id,
          pad_id=cfg.pad_id), alpha=3.0, bos_id=cfg.bos_id,
      eos_id=cfg.eos_id, pad_id=cfg.pad_id,
      windows=windows), static_argnums=0)
  windowed, whole = run(decoding.cache_windows(64)), run(None)
  assert int(whole.step) > 48  # the search ran through every window
  # Attention sums over a window, not over all 40 positions: the same
  # hypotheses, scores and cache up to float rounding.
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5,
                                 atol=1e-5), windowed, whole)
  np.testing.assert_array_equal(windowed.finished_sequences,
                                whole.finished_sequences)
  grown = decoding.beam_decode(params, src, cfg, beam_size=2, alpha=3.0,
                               max_len=64, n_best=2, grow_cache=True)
  np.testing.assert_array_equal(grown.sequences,
                                whole.finished_sequences[:, :, 1:])


def test_a_copy_model_copies_with_beam_four(small_copy_config,
                                            train_copy_model):
  cfg = small_copy_config
  state, _, _ = train_copy_model(cfg)
  sources = copy_task.eval_sequences(cfg, 256, 0)
  result = jax.jit(functools.partial(decoding.beam_decode, config=cfg,
                                     beam_size=4, alpha=0.6,
                                     max_len=cfg.copy_length + 1))(
                                         state.params, sources)
  assert copy_task.exact_match(np.asarray(result.sequences[:, 0]), sources,
                               cfg) == 1.0


def test_the_translate_command_lets_ended_sentences_leave_with_same_results(
    small_copy_config, train_copy_model, monkeypatch):
  """translate_ids in batches of 32 (stages of 32 and 8 rows) gives each
  sentence the translation it gets searched alone, under the exact rule.

  Which step a sentence ends at depends on the trained model (this one
  writes 6 tokens for any source, and the exact bound ends a sentence a
  step or two after its eos), so the batch is chosen from each sentence's
  own end: up to 4 that end last behind others that end sooner, whose
  first stage stops with those still searching."""
  cfg = small_copy_config
  state, _, _ = train_copy_model(cfg)
  rng = np.random.default_rng(0)
  drawn = [rng.integers(cfg.first_ordinary_id, cfg.src_vocab_size,
                        size=n).tolist() for n in rng.integers(1, 7, 96)]
  ends, taken = [], []
  first = translation._jit_first_stage  # pylint: disable=protected-access
  later = translation._jit_later_stage  # pylint: disable=protected-access
  monkeypatch.setattr(translation, '_jit_first_stage', lambda *a, **kw: (
      out := first(*a, **kw), ends.append(int(np.max(out[0].step))))[0])
  alone = [translation.translate_ids(state.params, cfg, [ids], beam_size=2,
                                     batch_size=1, stopping='exact')[0]
           for ids in drawn]
  assert len(ends) == len(drawn)  # one stage each: a row of 1 never narrows
  # Up to 4 that end at the latest step some sentences reach with enough
  # others ending sooner to fill the batch.
  for latest in sorted(set(ends), reverse=True)[:-1]:
    late = [i for i, end in enumerate(ends) if end >= latest][:4]
    sooner = [i for i, end in enumerate(ends) if end < latest]
    if len(late) + len(sooner) >= 32:
      break
  else:
    raise AssertionError(f'this model ends its sentences at steps '
                         f'{sorted(set(ends))}: too few apart')
  chosen = sooner[:32 - len(late)] + late
  sources = [drawn[i] for i in chosen]
  monkeypatch.setattr(
      translation, '_jit_later_stage', lambda *args, **kw: (
          taken.append(len(args[-1])), later(*args, **kw))[1])
  together = translation.translate_ids(state.params, cfg, sources, beam_size=2,
                                       batch_size=32, stopping='exact')
  assert taken == [8]  # those still searching went on in 8 rows
  assert together == [alone[i] for i in chosen]
  assert translation.translate_ids(state.params, cfg, sources, beam_size=2,
                                   batch_size=32, shrink_batches=False,
                                   stopping='exact') == together


def test_sentences_still_searching_at_the_first_stage_s_last_window_go_on(
    toy_config, monkeypatch):
  """A first stage stops at its cache's last window (48 of the toy's 64
  positions: its loop over the whole cache is not compiled); an untrained
  model's sentences run on, more than a quarter of its batch still
  searching there, and go on at the batch's width, then narrowed: each
  gets the translation it gets searched alone, and in one stage."""
  cfg = toy_config
  params = init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(5)
  sources = [rng.integers(cfg.first_ordinary_id, cfg.src_vocab_size,
                          size=n).tolist() for n in rng.integers(1, 7, 32)]
  steps, taken = [], []
  first = translation._jit_first_stage  # pylint: disable=protected-access
  later = translation._jit_later_stage  # pylint: disable=protected-access

  def first_stage(*args, **static):
    state, context = first(*args, **static)
    steps.append(np.asarray(state.step).tolist())
    return state, context

  monkeypatch.setattr(translation, '_jit_first_stage', first_stage)
  monkeypatch.setattr(
      translation, '_jit_later_stage', lambda *args, **kw: (
          taken.append(len(args[-1])), later(*args, **kw))[1])
  search_all = functools.partial(translation.translate_ids, params, cfg,
                                 beam_size=2, stopping='exact')
  together = search_all(sources, batch_size=32)
  assert steps == [[48]] and taken == [32, 8]
  alone = [search_all([ids], batch_size=1)[0] for ids in sources]
  assert together == alone
  assert search_all(sources, batch_size=32, shrink_batches=False) == alone


def test_a_file_s_sentences_share_one_source_length_and_keep_their_own_limits(
    small_copy_config, train_copy_model):
  """translate_ids pads every batch to the file's longest source (one shape:
  one first-stage program for short and long sentences), and each sentence
  still gets what it gets alone, padded only to its own length, under every
  stopping rule: its output limit is its own length + 50, not the file's."""
  cfg = small_copy_config
  state, _, _ = train_copy_model(cfg)
  rng = np.random.default_rng(2)
  sources = [rng.integers(cfg.first_ordinary_id, cfg.src_vocab_size,
                          size=n).tolist()
             for n in list(rng.integers(1, 7, 20)) + [40, 3]]
  first = translation._jit_first_stage  # pylint: disable=protected-access
  for stopping in search.STOPPING_RULES:
    before = first._cache_size()  # pylint: disable=protected-access
    together = translation.translate_ids(state.params, cfg, sources,
                                         beam_size=2, batch_size=8,
                                         stopping=stopping)
    # Three batches of 8, the last with the 40-token source: one shape.
    assert first._cache_size() == before + 1  # pylint: disable=protected-access
    alone = [translation.translate_ids(state.params, cfg, [ids], beam_size=2,
                                       batch_size=1, stopping=stopping)[0]
             for ids in sources]
    assert together == alone


def test_sentences_searched_in_refilled_slots_come_back_in_order_as_alone(
    small_copy_config, train_copy_model):
  """translate_ids(refill=True): 40 sentences of two source lengths through
  16 slots refilled 2 at a time, in one shape (3 programs); each comes back
  in its place, as beam_decode finds it alone at that shape."""
  cfg = small_copy_config
  state, _, _ = train_copy_model(cfg)
  rng = np.random.default_rng(1)
  sources = [rng.integers(cfg.first_ordinary_id, cfg.src_vocab_size,
                          size=n).tolist()
             for n in list(rng.integers(1, 7, 37)) + [17, 20, 18]]
  advance = translation._jit_advance  # pylint: disable=protected-access
  in_slots = translation.translate_ids(state.params, cfg, sources,
                                       beam_size=2, batch_size=16,
                                       refill=True)
  assert advance._cache_size() == 1  # pylint: disable=protected-access
  src_len = 32  # the longest source and eos, rounded up to 16
  search_alone = jax.jit(functools.partial(
      decoding.beam_decode, config=cfg, beam_size=2, alpha=cfg.eval_alpha,
      stopping=cfg.eval_stopping))
  for ids, found in zip(sources, in_slots):
    src = np.full((1, src_len), cfg.pad_id, np.int32)
    src[0, :len(ids) + 1] = ids + [cfg.eos_id]
    alone = search_alone(state.params, src)
    assert found == decoding.tokens_before_eos(alone.sequences[0, 0],
                                               cfg.eos_id, cfg.pad_id)
  assert len(set(map(tuple, in_slots))) > 30  # order shows


def test_the_translate_command_compiles_once_whatever_the_params_placement(
    small_copy_config, train_copy_model):
  """Host parameters (averaging makes them) reuse the programs compiled for
  the training state's device copy, instead of compiling their own."""
  cfg = small_copy_config
  state, _, _ = train_copy_model(cfg)
  sources = [[cfg.first_ordinary_id + i for i in range(n)] for n in (3, 5)]
  on_device = translation.translate_ids(state.params, cfg, sources, beam_size=2,
                                     batch_size=8)
  beams = translation._jit_first_stage  # pylint: disable=protected-access
  compiled = beams._cache_size()  # pylint: disable=protected-access
  on_host = translation.translate_ids(jax.tree.map(np.asarray, state.params),
                                   cfg, sources, beam_size=2, batch_size=8)
  assert on_host == on_device
  assert beams._cache_size() == compiled  # pylint: disable=protected-access


def test_jitted_user_code_compiles_once_and_runs_under_vmap(toy_model):
  cfg, params, src = toy_model
  traces = []

  @jax.jit
  def best_translation(params, src):
    traces.append(1)  # runs only while tracing
    return decoding.beam_decode(params, src, cfg, beam_size=3,
                                max_len=6).sequences[:, 0]

  first = best_translation(params, src)
  second = best_translation(params, src[::-1])
  assert len(traces) == 1
  np.testing.assert_array_equal(second, first[::-1])

  groups = jnp.stack([src, src[::-1]])  # [2, batch, src_len]
  batched = jax.vmap(lambda s: decoding.beam_decode(
      params, s, cfg, beam_size=3, max_len=6).sequences[:, 0])(groups)
  np.testing.assert_array_equal(batched[0], first)
  np.testing.assert_array_equal(batched[1], second)


_SHARDED_SCRIPT = textwrap.dedent('''
    import functools, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from flaxformer_mini import decoding, search, translation
    from flaxformer_mini.config import get_config
    from flaxformer_mini.training import init_params

    assert jax.device_count() == 8, jax.devices()
    cfg = get_config('toy').replace(d_model=16, num_heads=4, d_ff=32)
    params = init_params(cfg, jax.random.key(0))
    src = jnp.asarray(np.random.default_rng(0).integers(3, 11, (16, 5)),
                      jnp.int32)
    decode = functools.partial(decoding.beam_decode, config=cfg, beam_size=4,
                               max_len=8, n_best=2)
    first = jax.devices()[0]
    one = jax.jit(decode)(jax.device_put(params, first),
                          jax.device_put(src, first))
    mesh = Mesh(np.array(jax.devices()), ('data',))
    sharded_src = jax.device_put(src, NamedSharding(mesh, P('data')))
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    eight = jax.jit(decode)(replicated, sharded_src)
    assert len(eight.sequences.sharding.device_set) == 8
    print(json.dumps({
        'same_sequences': bool(np.array_equal(np.asarray(one.sequences),
                                              np.asarray(eight.sequences))),
        'score_gap': float(np.max(np.abs(np.asarray(one.scores) -
                                         np.asarray(eight.scores)))),
    }))
''')


@pytest.mark.slow
@pytest.mark.versions
def test_a_batch_sharded_over_eight_devices_decodes_as_on_one():
  env = dict(os.environ,
             XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  result = subprocess.run([sys.executable, '-c', _SHARDED_SCRIPT],
                          capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report['same_sequences']
  assert report['score_gap'] < 1e-5


_EVERY_DEVICE_SCRIPT = textwrap.dedent('''
    import json, pickle, sys
    import jax, numpy as np
    from flaxformer_mini import translation

    assert jax.local_device_count() == 8, jax.devices()
    with open(sys.argv[1], 'rb') as f:
      cfg, params, sources = pickle.load(f)
    stages, first = [], translation._jit_first_stage
    def first_stage(params, src, **static):
      state, context = first(params, src, **static)
      done = np.asarray(state.done).reshape(8, -1)
      stages.append({'devices': len(state.done.sharding.device_set),
                     'idle': bool(done.all(1).any() and not done.all())})
      return state, context
    translation._jit_first_stage = first_stage
    later = translation._jit_later_stage
    def later_stage(params, state, context, keep, **static):
      state, context = later(params, state, context, keep, **static)
      done = np.asarray(state.done).reshape(8, -1)
      stages.append({'rows': len(keep),
                     'idle': bool(done.all(1).any() and not done.all())})
      return state, context
    translation._jit_later_stage = later_stage
    print(json.dumps({
        'beam': translation.translate_ids(params, cfg, sources, beam_size=2,
                                          batch_size=24),
        'greedy': translation.translate_ids(params, cfg, sources,
                                            beam_size=1, batch_size=4),
        'sampled': translation.translate_ids(
            params, cfg, sources, batch_size=4,
            sampling=translation.Sampling(seed=3, num_samples=2)),
        'refill': translation.translate_ids(params, cfg, sources,
                                            beam_size=2, batch_size=8,
                                            refill=True),
        'stages': stages}))
''')


@pytest.mark.slow
@pytest.mark.versions
def test_every_device_searches_its_share_and_each_sentence_gets_its_own(
    toy_config, tmp_path):
  """translate_ids over 8 devices (a CPU host split in 8, as on a GPU node):
  each batch's rows split over all of them, each device narrowing its own
  share in stages; every beam, greedy, sampled and refilled translation is
  the one a single device gives, in the input's order."""
  # An untrained model: its sentences end anywhere from step 1 to the limit.
  cfg = toy_config.replace(d_model=16, num_heads=4, d_ff=32)
  rng = np.random.default_rng(4)
  sources = [rng.integers(cfg.first_ordinary_id, cfg.src_vocab_size,
                          size=n).tolist() for n in rng.integers(1, 7, 45)]
  sources[7] = []  # an empty line stays empty
  # 192 one-token sources before them fill a first batch of 8 x 24 rows
  # (sorted by length, ties in input order): the 45 make the second batch,
  # 147 of its rows fillers, as an input's last batch has them.
  extra = np.random.default_rng(5)
  sources = [extra.integers(cfg.first_ordinary_id, cfg.src_vocab_size,
                            size=1).tolist() for _ in range(192)] + sources
  params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
  (tmp_path / 'model.pickle').write_bytes(
      pickle.dumps((cfg, params, sources)))
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  result = subprocess.run(
      [sys.executable, '-c', _EVERY_DEVICE_SCRIPT,
       str(tmp_path / 'model.pickle')], capture_output=True, text=True,
      cwd=ROOT, env=env, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  eight = json.loads(result.stdout.strip().splitlines()[-1])
  # Each batch's first stage on all 8 devices (the second's called before
  # the host waits on the first's) up to its cache's last window (48 of 64
  # positions), where more than a quarter of some device's items still
  # search: each goes on at 8 x 24 rows. That ends every sentence of the
  # first batch; the second's go on in 8 x 8 (each device keeps a quarter
  # of its 24, rounded up to 8), a device whose items have all ended among
  # them.
  assert eight['stages'] == [{'devices': 8, 'idle': False},
                             {'devices': 8, 'idle': False},
                             {'rows': 192, 'idle': False},
                             {'rows': 192, 'idle': True},
                             {'rows': 64, 'idle': False}]
  assert eight['beam'] == translation.translate_ids(
      params, cfg, sources, beam_size=2, batch_size=16)
  assert eight['greedy'] == translation.translate_ids(
      params, cfg, sources, beam_size=1, batch_size=16)
  assert eight['sampled'] == translation.translate_ids(
      params, cfg, sources, batch_size=16,
      sampling=translation.Sampling(seed=3, num_samples=2))
  assert eight['refill'] == eight['beam']
  # Translations of every length from none to the limit.
  assert eight['beam'][192 + 7] == []
  assert len(set(map(len, eight['beam']))) >= 8


def test_an_input_too_small_for_a_batch_is_searched_in_a_smaller_one(
    toy_model, monkeypatch):
  """A line or two is not searched among a batch of copies of itself: an
  input that cannot fill batch_size rows per device gets the least power of
  two from 8 that holds it, and the same translations."""
  cfg, params, _ = toy_model
  rng = np.random.default_rng(0)
  sources = [rng.integers(cfg.first_ordinary_id, cfg.src_vocab_size,
                          size=n).tolist() for n in rng.integers(1, 7, 40)]
  rows, first = [], translation._jit_first_stage  # pylint: disable=protected-access
  def first_stage(params, src, **static):
    rows.append(len(src))
    return first(params, src, **static)
  monkeypatch.setattr(translation, '_jit_first_stage', first_stage)
  whole = translation.translate_ids(params, cfg, sources, beam_size=2)
  for count, expected in ((1, 8), (9, 16), (33, 64)):
    rows.clear()
    assert translation.translate_ids(
        params, cfg, sources[:count], beam_size=2) == whole[:count]
    assert set(rows) == {expected}, count
  # Per device, within batch_size: 20 lines on 2 devices need 10 each.
  assert translation._rows_per_device(20, 64, devices=2) == 16  # pylint: disable=protected-access
  assert translation._rows_per_device(20, 12, devices=1) == 12  # pylint: disable=protected-access


def test_a_batch_is_dealt_to_the_devices_by_length_in_turn(toy_config):
  """Each device's share of a batch spans its lengths: device d gets the
  d-th, d + devices-th, ... shortest; filler rows (None) repeat the
  batch's shortest source."""
  cfg = toy_config
  sources = [[5] * n for n in (3, 1, 4, 2, 6, 5, 7)]
  batches = list(translation._length_batches(cfg, sources, batch_size=2,
                                             devices=2))
  # Sorted by length: sources 1, 3, 0, 2 | 5, 4, 6 (+ one filler).
  assert [members for members, _ in batches] == [[1, 0, 3, 2], [5, 6, 4, None]]
  src = batches[1][1]
  assert src.shape == (4, 16)
  np.testing.assert_array_equal(src[3], src[0])  # the filler: source 5 again
  assert (src[1] != cfg.pad_id).sum() == 8  # source 6: 7 ids and eos


def _steps_until_done(stopping, n_best=1, beam_size=2, max_len=40,
                      limit=None, eos_prob=0.6):
  """The step at which a hand-made search is done under a stopping rule.

  The chain: from any token, eos 0.6 and a 0.4 (nothing else). With
  alpha 1 and beam 2, [eos] finishes at step 1 (score log 0.6 = -0.51),
  [a, eos] at step 2 ((log 0.4 + log 0.6) / lp(2) = -1.22, lp(k) =
  (5 + k) / 6), and the live [a, ..., a] of step k has log p = k log 0.4 =
  -0.92 k:
    beam_finished: done at step 2, when [a, eos] fills the second slot;
    current_length: step 2, the second slot filled and -1.22 >= the live
      -1.83 / lp(2) = -1.57;
    exact, n_best 1: the first k with -0.51 >= -0.92 k / lp(40), lp(40) =
      45 / 6: k = 5;
    exact, n_best 2: the same against the second finished score, -1.22:
      k = 11 (the rule before n_best counted, which waited for the worst of
      the beam's finished ones);
    exact, the item's limit 10: the bound is lp(10) = 15 / 6: k = 2.
  With eos 0.4 and a 0.6, the finished [eos] and [a, eos] score -0.92 and
  -1.22 and the live -0.51 k / lp(k), which first falls below -1.22 at
  k = 4 (-1.36; -1.15 at k = 3): current_length ends at step 4, after
  beam_finished (2) and long before exact (-0.92 >= -0.51 k / lp(40) at
  k = 14).
  """
  pad, bos, eos, a = range(4)
  # From every token alike: eos or a.
  probs = np.tile([0, 0, eos_prob, 1 - eos_prob], (4, 1))
  with np.errstate(divide='ignore'):
    transition_logits = jnp.asarray(np.log(probs), jnp.float32)
  steps = []

  def tokens_to_logits(tokens, cache):
    return transition_logits[tokens[:, 0]], cache

  def on_step(state):
    if bool(state.done[0]) and not steps:
      steps.append(int(state.step))

  result = search.beam_search(
      tokens_to_logits, jnp.zeros((1,)), batch_size=1, beam_size=beam_size,
      max_len=max_len, alpha=1.0, bos_id=bos, eos_id=eos, pad_id=pad,
      n_best=n_best, stopping=stopping, on_step=on_step,
      limits=None if limit is None else jnp.array([limit]))
  jax.effects_barrier()
  np.testing.assert_array_equal(result.sequences[0, 0, :2], [eos, pad])
  return steps[0]


def test_each_stopping_rule_ends_the_search_at_the_step_it_should():
  assert _steps_until_done('current_length') == 2
  assert _steps_until_done('current_length', eos_prob=0.4) == 4
  assert _steps_until_done('beam_finished') == 2
  assert _steps_until_done('beam_finished', eos_prob=0.4) == 2
  assert _steps_until_done('exact', eos_prob=0.4) == 14
  assert _steps_until_done('exact') == 5
  assert _steps_until_done('exact', n_best=2) == 11
  assert _steps_until_done('exact', limit=10) == 2
  assert _steps_until_done('exact', max_len=10) == 2


@pytest.mark.parametrize('stopping', search.STOPPING_RULES)
def test_each_item_s_limit_ends_its_search_as_that_max_len_would(stopping):
  """Items of one batch with limits of their own: each returns what it
  returns searched alone with max_len = its limit (cut there, bounded by it),
  padded after; limits of max_len change nothing."""
  tokens_to_logits, _, cache, ids = _history_search_pieces()
  limits = np.array([3, 12, 5, 8, 1, 12, 7, 4], np.int32)
  run = lambda cache, max_len, **kw: search.beam_search(
      tokens_to_logits, cache, batch_size=len(cache['item']), beam_size=3,
      max_len=max_len, alpha=0.6, n_best=3, stopping=stopping, **ids, **kw)
  limited = jax.jit(lambda limits: run(cache, 12, limits=limits))(limits)
  assert not np.asarray(limited.reached_eos).all()  # some were cut
  for i, limit in enumerate(limits):
    one = jax.tree.map(lambda leaf, i=i: leaf[i:i + 1], cache)
    alone = run({**one, 'history': one['history'][:, :limit]}, int(limit))
    np.testing.assert_array_equal(limited.sequences[i, :, :limit],
                                  alone.sequences[0])
    assert (np.asarray(limited.sequences[i, :, limit:]) == ids['pad_id']).all()
    for field in ('scores', 'lengths', 'reached_eos'):
      np.testing.assert_array_equal(getattr(limited, field)[i],
                                    getattr(alone, field)[0])
  jax.tree.map(np.testing.assert_array_equal,
               run(cache, 12, limits=np.full(8, 12)), run(cache, 12))


def test_limits_outside_the_search_are_one_line():
  tokens_to_logits, _, cache, ids = _history_search_pieces()
  for limits, message in (
      (np.array([3, 13] * 4), r'^limits from 3 to 13: each must lie in '
       r'\[1, max_len=12\]\.$'),
      (np.array([3, 5]), r'^limits of shape \(2,\): must be one per item, '
       r'\(8,\)\.$')):
    with pytest.raises(ValueError, match=message):
      search.beam_search(tokens_to_logits, cache, batch_size=8, beam_size=3,
                         max_len=12, alpha=0.6, limits=limits, **ids)


@pytest.mark.parametrize('stopping', search.STOPPING_RULES)
def test_under_every_rule_a_sentence_ends_as_it_would_alone(stopping):
  """An item that is done keeps its result while slower items search on, so
  what it returns does not depend on its batch (or on stages)."""
  tokens_to_logits, ids = _countdown_search_pieces()
  left = jnp.array([1, 6, 2, 9, 0, 4, 3, 7], jnp.int32)
  run = lambda lefts: search.beam_search(
      tokens_to_logits, {'left': lefts}, batch_size=len(lefts), beam_size=3,
      max_len=14, alpha=0.6, stopping=stopping, **ids)
  together = run(left)
  for i in range(len(left)):
    alone = run(left[i:i + 1])
    for field in ('sequences', 'scores', 'lengths', 'reached_eos'):
      np.testing.assert_array_equal(getattr(alone, field)[0],
                                    getattr(together, field)[i])


def test_an_unknown_stopping_rule_is_one_line():
  tokens_to_logits, ids = _countdown_search_pieces()
  with pytest.raises(ValueError, match=r"^stopping='early': choose one of "
                     r"'exact', 'beam_finished', 'current_length'\.$"):
    search.beam_search(tokens_to_logits, {'left': jnp.zeros((1,), jnp.int32)},
                       batch_size=1, beam_size=2, max_len=3, alpha=0.6,
                       stopping='early', **ids)
