import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_mini import decoding, search, translation
from flaxformer_mini.masks import padding_mask, target_mask
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import init_params


def _full_logits(cfg, params, src, tgt_in):
  return Transformer(cfg).apply(
      {'params': params}, src, tgt_in, padding_mask(src, cfg.pad_id),
      target_mask(tgt_in, cfg.pad_id))


# Cached decoding equals the full forward pass for every switch of the
# config: test_switches.py.


def test_the_encoder_output_is_projected_once_not_at_every_step(toy_model):
  cfg, params, src = toy_model
  src_mask = padding_mask(src, cfg.pad_id)
  model = Transformer(cfg)
  encoded = model.apply({'params': params}, src, src_mask,
                        method=Transformer.encode)
  cross_kv = decoding.project_cross_kv(params, cfg, encoded, src_mask)
  for layer in range(cfg.num_decoder_layers):
    entry = cross_kv['decoder'][f'layer_{layer}']['cross_attention']
    assert entry['key'].shape == entry['value'].shape == (4, 4, 5, 4)
  cache = decoding.init_cache(cfg, 4, max_len=4)
  tokens = jnp.full((4, 1), cfg.bos_id, jnp.int32)

  def step(variables):
    return model.apply(variables, encoded, src_mask, tokens, incremental=True,
                       mutable=['cache'], method=Transformer.decode)

  with_kv = {'params': params, 'cache': cache, 'cross_kv': cross_kv}
  without = {'params': params, 'cache': cache}
  np.testing.assert_allclose(step(with_kv)[0], step(without)[0],
                             rtol=1e-6, atol=1e-6)
  # Without cross_kv each layer projects the encoder output (W^K, W^V) again.
  def matmuls(variables):
    return str(jax.make_jaxpr(step)(variables)).count('dot_general')
  assert matmuls(without) - matmuls(with_kv) == 2 * cfg.num_decoder_layers


def test_a_sentences_beams_read_its_cross_attention_keys_once(toy_model):
  # tokens_to_logits over 3 rows per sentence keeps one row of cross-
  # attention keys/values per sentence, and each row's logits are those
  # of the same step with the encoder output repeated for every row.
  cfg, params, src = toy_model
  src_mask = padding_mask(src, cfg.pad_id)
  encoded = Transformer(cfg).apply({'params': params}, src, src_mask,
                                   method=Transformer.encode)
  rows = 3 * src.shape[0]
  grouped = decoding.transformer_tokens_to_logits(params, cfg, encoded,
                                                  src_mask)
  repeated = decoding.transformer_tokens_to_logits(
      params, cfg, search.expand_to_beams(encoded, 3),
      search.expand_to_beams(src_mask, 3))
  cross_kv = jax.make_jaxpr(grouped)(
      jnp.zeros((rows, 1), jnp.int32), decoding.init_cache(cfg, rows, 4))
  assert f'f32[{src.shape[0]},{cfg.num_heads},5,' in str(cross_kv)
  assert f'f32[{rows},{cfg.num_heads},5,' not in str(cross_kv)
  caches = [decoding.init_cache(cfg, rows, 4)] * 2
  for step in range(3):
    tokens = jnp.arange(rows, dtype=jnp.int32)[:, None] % 7 + 3 + step
    (ours, caches[0]), (theirs, caches[1]) = (
        grouped(tokens, caches[0]), repeated(tokens, caches[1]))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_greedy_equals_a_naive_loop_over_the_full_model(toy_model):
  cfg, params, src = toy_model
  max_len = 6
  ours = np.asarray(decoding.greedy_decode(params, src, cfg, max_len=max_len))
  assert ours.shape == (4, max_len)
  # Naive greedy: rerun the whole model on the growing prefix, from bos.
  prefix = jnp.full((4, 1), cfg.bos_id, jnp.int32)
  for _ in range(max_len):
    logits = _full_logits(cfg, params, src, prefix)
    logits = logits.at[..., jnp.array([cfg.pad_id, cfg.bos_id])].set(-jnp.inf)
    prefix = jnp.concatenate(
        [prefix, jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)], 1)
  naive = np.asarray(prefix[:, 1:])
  for row_ours, row_naive in zip(ours, naive):
    eos = np.flatnonzero(row_naive == cfg.eos_id)
    stop = eos[0] + 1 if eos.size else max_len
    np.testing.assert_array_equal(row_ours[:stop], row_naive[:stop])
    assert np.all(row_ours[stop:] == cfg.pad_id)


def test_greedy_search_stops_each_row_at_eos_and_pads_after():
  eos, pad, bos = 2, 0, 1
  # A fake model whose next token is a fixed script per row.
  script = jnp.array([[5, eos, 6, 7], [5, 6, 7, 8], [eos, 5, 5, 5]])

  def tokens_to_logits(tokens, step):
    del tokens
    return jax.nn.one_hot(script[:, step], 10) * 10, step + 1

  out = search.greedy_search(tokens_to_logits, jnp.asarray(0), batch_size=3,
                             max_len=4, bos_id=bos, eos_id=eos, pad_id=pad)
  np.testing.assert_array_equal(
      out, [[5, eos, pad, pad], [5, 6, 7, 8], [eos, pad, pad, pad]])


def test_greedy_decode_compiles_under_jit(toy_model):
  cfg, params, src = toy_model
  jitted = jax.jit(functools.partial(decoding.greedy_decode, config=cfg,
                                     max_len=5))
  np.testing.assert_array_equal(jitted(params, src),
                                decoding.greedy_decode(params, src, cfg,
                                                       max_len=5))


def test_max_len_beyond_the_position_table_is_refused(toy_model):
  cfg, params, src = toy_model
  with pytest.raises(ValueError, match='max_len'):
    decoding.greedy_decode(params, src, cfg, max_len=cfg.max_len + 1)


def _bigram(vocab=6):
  """A model without state: the next token's logits depend on the last."""
  table = jax.random.normal(jax.random.key(0), (vocab, vocab))
  return lambda tokens, cache: (table[tokens[:, 0]], cache)


@pytest.mark.parametrize('call, message', [
    (lambda cfg, p, s: decoding.beam_decode(p, s[0], cfg),
     r'^src of shape \(5,\): expected int32\[batch, src_len\], one row of '
     r'token ids per sentence \(one sentence: src\[None\]\)\.$'),
    (lambda cfg, p, s: decoding.greedy_decode(p, s[None], cfg),
     r'^src of shape \(1, 4, 5\): expected int32\[batch, src_len\]'),
    (lambda cfg, p, s: decoding.greedy_decode(p, s.astype(jnp.float32), cfg),
     r'^src of dtype float32: expected integer token ids\.$'),
    (lambda cfg, p, s: decoding.beam_decode(p, s.at[1, 0].set(99), cfg),
     r'^src holds the id 99: ids must lie in \[0, src_vocab_size=9\) '
     r"\(encode with the run's own vocabulary\)\.$"),
    (lambda cfg, p, s: decoding.beam_decode(p, s, cfg, beam_size=0),
     r'^beam_size=0: must be a positive int \(a shape, static under jit\)\.$'),
    (lambda cfg, p, s: decoding.beam_decode(p, s, cfg, n_best=5),
     r'^n_best=5: must lie in \[1, beam_size=4\]\.$'),
    (lambda cfg, p, s: search.greedy_search(
        _bigram(), None, batch_size=2, max_len=3, bos_id=1, eos_id=6,
        pad_id=0),
     r'^eos_id=6: outside the vocabulary of 6 tokens that tokens_to_logits '
     r'scores\.$'),
    (lambda cfg, p, s: search.beam_search(
        _bigram(), None, batch_size=2, beam_size=2, max_len=3, alpha=0.6,
        bos_id=-1, eos_id=2, pad_id=0),
     r'^bos_id=-1: outside the vocabulary of 6 tokens'),
    (lambda cfg, p, s: search.beam_search(
        _bigram(), {'h': jnp.zeros((6, 3))}, batch_size=2, beam_size=3,
        max_len=3, alpha=0.6, bos_id=1, eos_id=2, pad_id=0),
     r"^cache\['h'\] has 6 rows; every non-scalar leaf must be "
     r'\[batch_size=2, \.\.\.\] \(the search repeats it over beams itself\)\.$'),
    (lambda cfg, p, s: search.start_slots(
        {'h': jnp.zeros((2, 3))}, {'kv': jnp.zeros((6, 3))}, slots=2,
        beam_size=3, max_len=3, bos_id=1, pad_id=0),
     r"^context\['kv'\] has 6 rows; every non-scalar leaf must be "
     r'\[batch_size=2, \.\.\.\] \(one row per item, read by all of its '
     r'beams\)\.$'),
])
def test_a_client_mistake_is_one_line_naming_it(toy_model, call, message):
  cfg, params, src = toy_model
  with pytest.raises(ValueError, match=message):
    call(cfg, params, src)


def test_a_model_that_says_its_vocab_size_is_checked_without_a_trace_apart(
    toy_model):
  """The Transformer's tokens_to_logits says its vocabulary: the search's
  check takes it at its word (one trace of the model fewer in every program
  that searches), and still refuses an id outside it in one line."""
  cfg, params, src = toy_model
  src_mask = padding_mask(src, cfg.pad_id)
  encoded = Transformer(cfg).apply({'params': params}, src, src_mask,
                                   method=Transformer.encode)
  model = decoding.transformer_tokens_to_logits(params, cfg, encoded,
                                                src_mask)
  assert model.vocab_size == cfg.tgt_vocab_size
  traces = []

  def counted(tokens, cache):
    traces.append(tokens.shape)
    return model(tokens, cache)

  def search_with(tokens_to_logits, eos_id=cfg.eos_id):
    return search.beam_search(
        tokens_to_logits, decoding.init_cache(cfg, src.shape[0], 6),
        batch_size=src.shape[0], beam_size=2, max_len=6, alpha=0.6,
        bos_id=cfg.bos_id, eos_id=eos_id, pad_id=cfg.pad_id)

  search_with(counted)  # no vocab_size: traced apart, then the loop's body
  assert len(traces) == 2
  counted.vocab_size = model.vocab_size
  traces.clear()
  result = search_with(counted)
  assert len(traces) == 1  # the loop's body alone
  np.testing.assert_array_equal(
      result.sequences,
      decoding.beam_decode(params, src, cfg, beam_size=2, max_len=6).sequences)
  with pytest.raises(ValueError, match=(
      r'^eos_id=9: outside the vocabulary of 9 tokens that tokens_to_logits '
      r'scores\.$')):
    search_with(model, eos_id=cfg.tgt_vocab_size)


def test_every_search_takes_its_sizes_and_ids_by_keyword():
  """Five ints in an order of their own used to pass silently when swapped."""
  import inspect  # pylint: disable=g-import-not-at-top
  for function in (search.greedy_search, search.beam_search,
                   decoding.greedy_decode, decoding.beam_decode,
                   translation.translate_ids, translation.translate_lines):
    positional = [name for name, p in inspect.signature(
        function).parameters.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional in (['tokens_to_logits', 'cache'],
                          ['params', 'src', 'config'],
                          ['params', 'config', 'sources'],
                          ['params', 'config', 'tokenizer', 'lines']), (
                              function.__name__, positional)


def test_logits_with_a_length_axis_of_one_are_taken_by_both_searches():
  bigram = _bigram()
  unsqueezed = lambda tokens, cache: (bigram(tokens, cache)[0][:, None], cache)
  ids = dict(bos_id=1, eos_id=2, pad_id=0)
  for model in (bigram, unsqueezed):
    greedy = search.greedy_search(model, None, batch_size=2, max_len=4, **ids)
    beam = search.beam_search(model, None, batch_size=2, beam_size=1,
                              max_len=4, alpha=0.0, **ids)
    np.testing.assert_array_equal(greedy, beam.sequences[:, 0])


def test_greedy_and_sampling_cut_each_sentence_at_its_own_length_plus_50(
    toy_model):
  """As beam_decode: the batch's src_len + 50 positions, and a sentence
  padded within its batch gets what it gets alone (source 2 tokens: 52).
  These parameters never draw eos for that source, so it runs to its limit."""
  cfg, _, src = toy_model
  params = init_params(cfg, jax.random.key(1))
  keys = jax.random.split(jax.random.key(5), 4)
  decode = {
      'greedy': lambda src: decoding.greedy_decode(params, src, cfg),
      'sample': lambda src: decoding.sample_decode(
          params, src, cfg, rng=keys[3:] if len(src) == 1 else keys,
          temperature=0.5)[:, 0]}
  for name, run in decode.items():
    batch = np.asarray(run(src))
    assert batch.shape == (4, decoding.default_max_len(cfg, src.shape[1])), name
    alone = np.asarray(run(src[3:, :2]))
    assert alone.shape == (1, 52) and (alone != cfg.eos_id).all(), name
    np.testing.assert_array_equal(batch[3, :52], alone[0], err_msg=name)
    assert (batch[3, 52:] == cfg.pad_id).all(), name


def test_the_mask_helpers_and_the_length_penalty_are_exported():
  import flaxformer_mini as fm  # pylint: disable=g-import-not-at-top
  from flaxformer_mini import masks  # pylint: disable=g-import-not-at-top
  assert fm.padding_mask is masks.padding_mask
  assert fm.target_mask is masks.target_mask
  assert fm.length_penalty is search.length_penalty
  assert dir(fm) == fm.__all__ and 'importlib' not in dir(fm)
