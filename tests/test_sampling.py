"""Sampling (search.sample_search, decoding.sample_decode): the same tokens ->
logits interface as greedy and beam search, a PRNG key in."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_mini import decoding, search

PAD, BOS, EOS, A, B = range(5)
# A Markov chain over pad, bos, eos, a, b: the probabilities of the next token
# given the last (as in test_beam_search's).
CHAIN = np.zeros((5, 5))
CHAIN[BOS, [EOS, A, B]] = [0.45, 0.5, 0.05]
CHAIN[A, [EOS, A, B]] = [0.7, 0.2, 0.1]
CHAIN[B, [EOS, A, B]] = [0.1, 0.1, 0.8]


def _chain(tokens, cache):
  with np.errstate(divide='ignore'):
    return jnp.asarray(np.log(CHAIN), jnp.float32)[tokens[:, 0]], cache


def _draw_from_chain(rows: int, max_len: int, **options):
  return np.asarray(jax.jit(functools.partial(
      search.sample_search, _chain, None, batch_size=rows, max_len=max_len,
      bos_id=BOS, eos_id=EOS, pad_id=PAD, **options))(
          rng=jax.random.key(7)))


def _assert_frequencies(drawn, expected: dict):
  """Each sequence's share of the rows within 5 standard errors of its
  probability, and nothing drawn outside `expected`."""
  rows = len(drawn)
  seen = {}
  for row in map(tuple, drawn):
    seen[row] = seen.get(row, 0) + 1
  assert set(seen) <= set(expected), set(seen) - set(expected)
  for sequence, p in expected.items():
    error = 5 * np.sqrt(p * (1 - p) / rows)
    assert abs(seen.get(sequence, 0) / rows - p) <= error, (sequence, p)


def test_two_tokens_are_drawn_with_the_chains_probabilities():
  drawn = _draw_from_chain(20_000, max_len=2)
  _assert_frequencies(drawn, {
      (EOS, PAD): 0.45, (A, EOS): 0.35, (A, A): 0.1, (A, B): 0.05,
      (B, EOS): 0.005, (B, A): 0.005, (B, B): 0.04})


@pytest.mark.parametrize('options, expected', [
    # softmax(log p / 2) = sqrt(p), renormalised
    ({'temperature': 2.0}, np.sqrt([0.45, 0.5, 0.05]) /
     np.sqrt([0.45, 0.5, 0.05]).sum()),
    ({'top_k': 2}, [0.45 / 0.95, 0.5 / 0.95, 0.0]),
    # a (0.5) is kept; eos too, as the mass before it (0.5) is below 0.6;
    # b is not (0.95 before it)
    ({'top_p': 0.6}, [0.45 / 0.95, 0.5 / 0.95, 0.0]),
    ({'top_p': 0.5}, [0.0, 1.0, 0.0]),  # a alone reaches 0.5
])
def test_temperature_top_k_and_top_p_reshape_the_distribution(options,
                                                             expected):
  drawn = _draw_from_chain(20_000, max_len=1, **options)
  _assert_frequencies(drawn, {(token,): p for token, p in
                              zip((EOS, A, B), expected) if p})


def test_top_p_one_keeps_every_token_even_past_a_rounded_full_mass():
  # In float32 the first token's probability rounds to 1, so the mass
  # before the second is 1: a nucleus of p = 1 must still keep it ("1: all
  # tokens"), traced or not; a smaller p cuts it.
  logits = jnp.array([[0.0, -30.0, -31.0]], jnp.float32)
  cut = jax.jit(search._top_p)  # pylint: disable=protected-access
  np.testing.assert_array_equal(cut(logits, 1.0), logits)
  np.testing.assert_array_equal(search._top_p(logits, 1.0), logits)  # pylint: disable=protected-access
  np.testing.assert_array_equal(cut(logits, 0.5),
                                [[0.0, -np.inf, -np.inf]])


def test_the_draw_and_its_argmax_are_jax_s_own():
  # search's argmax and Gumbel-max draw (3x faster on a CPU than jax's):
  # the same indices as jnp.argmax, ties to the first, a NaN first where
  # there is one; the same tokens as jax.random.categorical.
  rng = np.random.default_rng(1)
  logits = np.round(rng.normal(size=(64, 300)), 1).astype(np.float32)
  logits[:8] = -np.inf
  logits[8:16, ::3] = -np.inf
  logits[16, [5, 40]] = np.nan
  logits[17] = logits[17].max()  # all tied
  argmax = jax.jit(search._argmax)  # pylint: disable=protected-access
  np.testing.assert_array_equal(argmax(logits), jnp.argmax(logits, -1))
  keys = jax.random.split(jax.random.key(3), 64)
  logits = np.where(np.isnan(logits), 0.0, logits)
  logits[:8, 7] = 0.0  # one token left to draw
  draw = jax.jit(jax.vmap(search._categorical))  # pylint: disable=protected-access
  np.testing.assert_array_equal(
      draw(keys, logits), jax.vmap(jax.random.categorical)(keys, logits))


def test_top_p_keeps_each_token_with_less_than_p_more_likely_than_it():
  # The nucleus, found by bisection over the float32 values, against its
  # definition in float64: logits of either sign and any scale, ties (0.0
  # beside -0.0 too), tokens at -inf (pad, bos, or cut by top_k).
  rng = np.random.default_rng(0)
  cut = jax.jit(search._top_p)  # pylint: disable=protected-access
  checked = 0
  for trial in range(300):
    logits = rng.normal(size=(4, int(rng.integers(2, 50))))
    logits = logits * rng.choice([0.01, 1.0, 30.0]) + rng.choice(
        [-1e4, -60.0, 0.0, 60.0])
    if trial % 3 == 0:
      logits = np.round(logits)
    logits = logits.astype(np.float32)
    logits[:, 0] = [-0.0, 0.0, -np.inf, logits[3, 1]]
    p = float(rng.uniform(0.02, 0.999))
    wide = logits.astype(np.float64)
    probs = np.exp(wide - wide.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    before = (probs[:, None, :] * (wide[:, None, :] > wide[:, :, None])).sum(-1)
    if np.any(np.abs(before - p) < 1e-4):
      continue  # float32's sums may fall either side of p
    expected = np.where(before < p, logits, -np.inf)
    np.testing.assert_array_equal(cut(jnp.asarray(logits), p), expected,
                                  err_msg=f'trial {trial}, p={p}')
    checked += 1
  assert checked > 250


@pytest.mark.parametrize('options', [{'top_k': 1}, {'temperature': 0.0},
                                     {'temperature': 1e-4}])
def test_top_k_one_and_temperature_to_zero_are_greedy(toy_model, options):
  cfg, params, src = toy_model
  greedy = decoding.greedy_decode(params, src, cfg, max_len=8)
  drawn = decoding.sample_decode(params, src, cfg, rng=jax.random.key(3),
                                 num_samples=3, max_len=8, **options)
  assert drawn.shape == (4, 3, 8)
  for sample in range(3):
    np.testing.assert_array_equal(drawn[:, sample], greedy)


def test_samples_differ_and_a_sentences_depend_on_its_key_alone(toy_model):
  cfg, params, src = toy_model
  keys = jax.random.split(jax.random.key(1), 4)
  drawn = np.asarray(decoding.sample_decode(params, src, cfg, rng=keys,
                                            num_samples=4, max_len=8))
  assert len({row.tobytes() for row in drawn.reshape(16, 8)}) > 4
  alone = decoding.sample_decode(params, src[2:3], cfg, rng=keys[2:3],
                                 num_samples=4, max_len=8)
  np.testing.assert_array_equal(alone[0], drawn[2])


def test_sampling_runs_under_jit_and_vmap_over_temperatures(toy_model):
  cfg, params, src = toy_model
  sample = lambda t: decoding.sample_decode(
      params, src, cfg, rng=jax.random.key(0), max_len=8, temperature=t)
  temperatures = jnp.array([0.0, 0.5, 1.0])
  together = jax.jit(jax.vmap(sample))(temperatures)
  for i, t in enumerate(temperatures):
    np.testing.assert_array_equal(together[i], sample(t))
  np.testing.assert_array_equal(
      together[0, :, 0], decoding.greedy_decode(params, src, cfg, max_len=8))


@pytest.mark.parametrize('options, message', [
    ({'top_p': 0.0}, r'^top_p=0.0: must lie in \(0, 1\]\.$'),
    ({'temperature': -1.0}, r'^temperature=-1.0: must be at least 0\.$'),
    ({'top_k': -2}, r'^top_k=-2: must be a positive int'),
])
def test_a_distribution_that_cannot_be_drawn_from_is_refused(options, message):
  with pytest.raises(ValueError, match=message):
    search.sample_search(_chain, None, rng=jax.random.key(0), batch_size=4,
                         max_len=1, bos_id=BOS, eos_id=EOS, pad_id=PAD,
                         **options)
