"""Every switch of the config, through the properties that hold whatever it is.

The variants are the base model and, one at a time, every other value of
every switch that `config.switches()` lists (each string choice of CHOICES
and each boolean field): a new switch is swept by adding it to the config,
with no test to edit. Each variant must leak nothing from the future, decode
with its cache exactly as the full pass computes, count 3 x its forward
products in the FLOPs behind every MFU figure, give every parameter a
gradient, and be toured and drawn as Figure 1.
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from flaxformer_mini import config as config_lib
from flaxformer_mini import decoding, plots, tour
from flaxformer_mini.masks import make_batch
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import create_train_state, init_params, train_step

sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import flops  # pylint: disable=g-import-not-at-top,wrong-import-position

BASE = config_lib.get_config('toy').replace(
    d_model=16, num_heads=4, d_ff=32, src_vocab_size=13, tgt_vocab_size=13,
    max_len=16)


def _variants() -> dict[str, config_lib.TransformerConfig]:
  variants = {'base': BASE}
  for name, values in config_lib.switches().items():
    for value in values:
      if value != getattr(BASE, name):
        variants[f'{name}={value}'] = BASE.replace(**{name: value})
  return variants


VARIANTS = _variants()


def test_every_switch_is_swept():
  """Each switch's every value is some variant's (the sweep is complete)."""
  for name, values in config_lib.switches().items():
    assert {getattr(v, name) for v in VARIANTS.values()} == set(values), name


def _tolerance(config) -> dict:
  return ({'rtol': 1e-5, 'atol': 1e-5} if config.dtype == 'float32' else
          {'rtol': 0.05, 'atol': 0.05})


@pytest.fixture(scope='module', params=list(VARIANTS))
def variant(request):
  """(name, config, params, batch: 3 pairs, source 6 with pad, target 7)."""
  config = VARIANTS[request.param]
  params = init_params(config, jax.random.key(5))
  rng = np.random.default_rng(1)
  src = rng.integers(3, config.src_vocab_size, size=(3, 6))
  src[2, 4:] = config.pad_id
  tgt = rng.integers(3, config.tgt_vocab_size, size=(3, 8))
  tgt[:, 0] = config.bos_id
  return request.param, config, params, make_batch(src, tgt, config)


def _logits(config, params, batch, tgt_in=None, src=None):
  return np.asarray(Transformer(config).apply(
      {'params': params}, batch.src if src is None else src,
      batch.tgt_in if tgt_in is None else tgt_in, batch.src_mask,
      batch.tgt_mask))


def test_no_future_token_and_no_source_pad_reaches_a_logit(variant):
  _, config, params, batch = variant
  base = _logits(config, params, batch)
  for t in range(1, batch.tgt_in.shape[1]):
    changed = _logits(config, params, batch, tgt_in=jnp.asarray(
        batch.tgt_in).at[:, t].set(jnp.where(batch.tgt_in[:, t] == 3, 4, 3)))
    np.testing.assert_array_equal(changed[:, :t], base[:, :t])
    assert not np.allclose(changed[:, t:], base[:, t:])  # the test can fail
  np.testing.assert_array_equal(
      _logits(config, params, batch,
              src=jnp.asarray(batch.src).at[2, 4:].set(5)), base)


def test_cached_decoding_equals_the_full_pass(variant):
  _, config, params, batch = variant
  full = _logits(config, params, batch)
  encoded = Transformer(config).apply({'params': params}, batch.src,
                                      batch.src_mask,
                                      method=Transformer.encode)
  step = jax.jit(decoding.transformer_tokens_to_logits(
      params, config, encoded, batch.src_mask))
  length = batch.tgt_in.shape[1]
  cache = decoding.init_cache(config, batch.src.shape[0], length)
  for t in range(length):
    logits, cache = step(batch.tgt_in[:, t:t + 1], cache)
    np.testing.assert_allclose(logits, full[:, t], **_tolerance(config))


def test_the_flops_behind_mfu_are_three_times_the_forward_products(variant):
  _, config, params, batch = variant
  forward = flops.traced_flops(
      lambda p, b: Transformer(config).apply({'params': p}, b.src, b.tgt_in,
                                             b.src_mask, b.tgt_mask),
      params, batch)
  assert flops.step_flops(config, batch.src.shape[0], batch.src.shape[1],
                          batch.tgt_in.shape[1]) == 3 * forward


def test_a_training_step_moves_every_parameter(variant):
  _, config, _, batch = variant
  state = create_train_state(config, jax.random.key(5))
  new, metrics = jax.jit(functools.partial(train_step, config=config))(
      state, batch, jax.random.key(0))
  assert np.isfinite(float(metrics['loss_sum']))
  unmoved = [jax.tree_util.keystr(path) for path, before, after in zip(
      *zip(*jax.tree_util.tree_leaves_with_path(state.params)),
      jax.tree.leaves(new.params)) if np.array_equal(before, after)]
  assert not unmoved


def test_the_tour_names_every_axis_and_figure_one_draws_it(variant):
  _, config, params, batch = variant
  stops = tour.tensor_tour(config, params, batch)
  for stop in stops:
    assert stop.axes.count(',') + 1 == len(stop.shape), stop.name
  texts = '\n'.join(t.get_text() for t in
                    plots.figure_one(stops, config).axes[0].texts)
  assert 'not in this model' not in texts
