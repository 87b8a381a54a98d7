import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_mini import decoding
from flaxformer_mini.masks import padding_mask, target_mask
from flaxformer_mini.model import Transformer, unroll_layers
from flaxformer_mini.training import init_params


@pytest.fixture(scope='module')
def setup(toy_config):
  cfg = toy_config.replace(d_model=16, num_heads=4, d_ff=32, src_vocab_size=9,
                           tgt_vocab_size=9)
  params = init_params(cfg, jax.random.key(7))
  rng = np.random.default_rng(1)
  src = rng.integers(3, cfg.src_vocab_size, size=(3, 6))
  src[2, 3:] = cfg.pad_id
  return cfg, params, jnp.asarray(src, jnp.int32)


def _full_logits(cfg, params, src, tgt_in):
  return Transformer(cfg).apply(
      {'params': params}, src, tgt_in, padding_mask(src, cfg.pad_id),
      target_mask(tgt_in, cfg.pad_id))


@pytest.mark.parametrize('pre_norm', [False, True])
def test_cached_decoding_equals_the_full_forward_pass(setup, pre_norm):
  cfg, _, src = setup
  cfg = cfg.replace(pre_norm=pre_norm)
  params = init_params(cfg, jax.random.key(8))
  tgt_in = jnp.asarray(np.random.default_rng(2).integers(
      3, cfg.tgt_vocab_size, size=(3, 7)), jnp.int32).at[:, 0].set(cfg.bos_id)
  full = _full_logits(cfg, params, src, tgt_in)
  src_mask = padding_mask(src, cfg.pad_id)
  encoded = Transformer(cfg).apply({'params': params}, src, src_mask,
                                   method=Transformer.encode)
  step = decoding.transformer_tokens_to_logits(params, cfg, encoded, src_mask)
  cache = decoding.init_cache(cfg, encoded, src_mask, max_len=7)
  for t in range(7):
    logits, cache = step(tgt_in[:, t:t + 1], cache)
    np.testing.assert_allclose(logits, full[:, t], rtol=1e-5, atol=1e-5)


def test_the_encoder_output_is_projected_once_not_at_every_step(setup):
  cfg, params, src = setup
  src_mask = padding_mask(src, cfg.pad_id)
  model = Transformer(cfg)
  encoded = model.apply({'params': params}, src, src_mask,
                        method=Transformer.encode)
  memory = decoding.project_memory(params, cfg, encoded, src_mask)
  for layer in range(cfg.num_decoder_layers):
    entry = memory['decoder'][f'layer_{layer}']['cross_attention']
    assert entry['key'].shape == entry['value'].shape == (3, 4, 6, 4)
  cache = decoding.init_cache(cfg, encoded, src_mask, max_len=4)
  tokens = jnp.full((3, 1), cfg.bos_id, jnp.int32)

  def step(variables):
    return model.apply(variables, encoded, src_mask, tokens, decode=True,
                       mutable=['cache'], method=Transformer.decode)

  with_memory = {'params': params, 'cache': cache, 'memory': memory}
  without = {'params': params, 'cache': cache}
  np.testing.assert_allclose(step(with_memory)[0], step(without)[0],
                             rtol=1e-6, atol=1e-6)
  # Without memory each layer projects the encoder output (W^K, W^V) again.
  def matmuls(variables):
    return str(jax.make_jaxpr(step)(variables)).count('dot_general')
  assert matmuls(without) - matmuls(with_memory) == 2 * cfg.num_decoder_layers


def test_beams_share_their_sentences_memory(setup):
  # Beam search keeps the encoder's keys and values once per sentence; each
  # beam's step must give the logits it gets with the encoder output copied
  # to every beam.
  cfg, params, src = setup
  beams, max_len = 2, 5
  src_mask = padding_mask(src, cfg.pad_id)
  encoded = Transformer(cfg).apply({'params': params}, src, src_mask,
                                   method=Transformer.encode)
  tgt_in = jnp.asarray(np.random.default_rng(3).integers(
      3, cfg.tgt_vocab_size, size=(3 * beams, max_len)), jnp.int32)
  expand = functools.partial(decoding.expand_to_beams, beam_size=beams)
  shared = decoding.transformer_tokens_to_logits(params, cfg, encoded,
                                                 src_mask)
  copied = decoding.transformer_tokens_to_logits(params, cfg, expand(encoded),
                                                 expand(src_mask))
  memory = decoding.project_memory(params, cfg, encoded, src_mask)
  assert memory['decoder']['layer_0']['cross_attention']['key'].shape[0] == 3
  cache = decoding.init_cache(cfg, expand(encoded), expand(src_mask), max_len)
  shared_cache = copied_cache = cache
  for t in range(max_len):
    shared_logits, shared_cache = shared(tgt_in[:, t:t + 1], shared_cache)
    copied_logits, copied_cache = copied(tgt_in[:, t:t + 1], copied_cache)
    np.testing.assert_allclose(shared_logits, copied_logits, rtol=1e-5,
                               atol=1e-6)


def test_a_scanned_model_decodes_as_the_unrolled_one(setup):
  cfg, _, src = setup
  scanned_cfg = cfg.replace(scan_layers=True)
  params = init_params(scanned_cfg, jax.random.key(2))
  per_layer = unroll_layers(params, cfg)
  np.testing.assert_array_equal(
      decoding.greedy_decode(params, src, scanned_cfg, max_len=6),
      decoding.greedy_decode(per_layer, src, cfg, max_len=6))
  scanned, plain = (decoding.beam_decode(p, src, c, beam_size=3, max_len=6)
                    for p, c in ((params, scanned_cfg), (per_layer, cfg)))
  np.testing.assert_array_equal(scanned.sequences, plain.sequences)
  np.testing.assert_allclose(scanned.scores, plain.scores, rtol=1e-6)
  with pytest.raises(ValueError, match='unrolled'):
    Transformer(scanned_cfg).apply(
        {'params': params}, jnp.zeros((3, 6, cfg.d_model)),
        padding_mask(src, cfg.pad_id), src[:, :1], decode=True,
        mutable=['cache'], method=Transformer.decode)


def test_greedy_equals_a_naive_loop_over_the_full_model(setup):
  cfg, params, src = setup
  max_len = 6
  ours = np.asarray(decoding.greedy_decode(params, src, cfg, max_len))
  assert ours.shape == (3, max_len)
  # Naive greedy: rerun the whole model on the growing prefix, from bos.
  prefix = jnp.full((3, 1), cfg.bos_id, jnp.int32)
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


def test_argmax_as_two_reductions_equals_jnp_argmax():
  scores = jax.random.normal(jax.random.key(0), (6, 50))
  scores = scores.at[1].set(0.0)  # all tied: the first index
  scores = scores.at[2, [7, 30]].set(9.0)  # a tie for the maximum
  scores = scores.at[3, [4, 20]].set(jnp.nan)  # the first NaN, as argmax
  scores = scores.at[4, 49].set(jnp.inf)
  scores = scores.at[5].set(-jnp.inf)
  np.testing.assert_array_equal(decoding._argmax(scores),  # pylint: disable=protected-access
                                jnp.argmax(scores, axis=-1))


def test_greedy_search_stops_each_row_at_eos_and_pads_after():
  eos, pad, bos = 2, 0, 1
  # A fake model whose next token is a fixed script per row.
  script = jnp.array([[5, eos, 6, 7], [5, 6, 7, 8], [eos, 5, 5, 5]])

  def tokens_to_logits(tokens, step):
    del tokens
    return jax.nn.one_hot(script[:, step], 10) * 10, step + 1

  out = decoding.greedy_search(tokens_to_logits, jnp.asarray(0), 3, 4, bos,
                               eos, pad)
  np.testing.assert_array_equal(
      out, [[5, eos, pad, pad], [5, 6, 7, 8], [eos, pad, pad, pad]])


def test_greedy_decode_compiles_under_jit(setup):
  cfg, params, src = setup
  jitted = jax.jit(functools.partial(decoding.greedy_decode, config=cfg,
                                     max_len=5))
  np.testing.assert_array_equal(jitted(params, src),
                                decoding.greedy_decode(params, src, cfg, 5))


def test_max_len_beyond_the_position_table_is_refused(setup):
  cfg, params, src = setup
  with pytest.raises(ValueError, match='max_len'):
    decoding.greedy_decode(params, src, cfg, cfg.max_len + 1)
