import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_mini import decoding, search
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


def test_greedy_equals_a_naive_loop_over_the_full_model(toy_model):
  cfg, params, src = toy_model
  max_len = 6
  ours = np.asarray(decoding.greedy_decode(params, src, cfg, max_len))
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

  out = search.greedy_search(tokens_to_logits, jnp.asarray(0), 3, 4, bos,
                             eos, pad)
  np.testing.assert_array_equal(
      out, [[5, eos, pad, pad], [5, 6, 7, 8], [eos, pad, pad, pad]])


def test_greedy_decode_compiles_under_jit(toy_model):
  cfg, params, src = toy_model
  jitted = jax.jit(functools.partial(decoding.greedy_decode, config=cfg,
                                     max_len=5))
  np.testing.assert_array_equal(jitted(params, src),
                                decoding.greedy_decode(params, src, cfg, 5))


def test_max_len_beyond_the_position_table_is_refused(toy_model):
  cfg, params, src = toy_model
  with pytest.raises(ValueError, match='max_len'):
    decoding.greedy_decode(params, src, cfg, cfg.max_len + 1)
