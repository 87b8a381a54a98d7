import contextlib
import functools
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import ad_checkpoint

from flaxformer_mini import losses
from flaxformer_mini.data import copy_task
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import create_train_state, eval_step, train_step


@pytest.fixture(scope='module')
def small_copy(small_copy_config):
  return small_copy_config


def test_gradient_is_that_of_the_mean_loss_per_real_token(small_copy):
  cfg = small_copy.replace(label_smoothing=0.1)
  state = create_train_state(cfg, jax.random.key(0))
  batch = copy_task.train_batch(cfg, 0)
  batch = batch.replace(
      tgt_out=jnp.asarray(batch.tgt_out).at[0, 3:].set(cfg.pad_id))

  def mean_loss(params):
    logits = Transformer(cfg).apply({'params': params}, batch.src,
                                    batch.tgt_in, batch.src_mask,
                                    batch.tgt_mask)
    total, count = losses.label_smoothed_kl(logits, batch.tgt_out,
                                            cfg.label_smoothing, cfg.pad_id)
    return total / count

  expected = jax.jit(jax.grad(mean_loss))(state.params)
  new_state, metrics = jax.jit(functools.partial(train_step, config=cfg))(
      state, batch, jax.random.key(1))
  # After one step Adam's first moment is (1 - beta1) * gradient.
  first_moment = new_state.opt_state[0].mu
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 0.1 * b, rtol=1e-4,
                                                       atol=1e-7),
               first_moment, expected)
  assert int(metrics['ntokens']) == int(jnp.sum(batch.tgt_out != cfg.pad_id))
  assert int(new_state.step) == 1


def test_accumulated_micro_batches_make_the_update_of_the_whole_batch(
    small_copy):
  """grad_accumulation=4: four micro-batches (of different real-token
  counts) give the updates of the one batch they make up, step by step."""
  cfg = small_copy.replace(dropout_rate=0.0, label_smoothing=0.1)
  batch = copy_task.train_batch(cfg, 0)
  rows = batch.tgt_out.shape[0]
  # Pad most of the first quarter: the micro-batches' token counts differ,
  # so averaging their mean gradients would not be the batch's gradient.
  batch = batch.replace(
      tgt_out=jnp.asarray(batch.tgt_out).at[:rows // 4, 2:].set(cfg.pad_id))
  counts = np.asarray(batch.tgt_out != cfg.pad_id).reshape(4, -1).sum(axis=1)
  assert len(set(counts.tolist())) > 1
  finals = {}
  for count in (1, 4):
    config = cfg.replace(grad_accumulation=count)
    step = jax.jit(functools.partial(train_step, config=config))
    state = create_train_state(config, jax.random.key(0))
    for _ in range(2):
      state, metrics = step(state, batch, jax.random.key(1))
    finals[count] = state, metrics
  (one, one_metrics), (four, four_metrics) = finals[1], finals[4]
  assert int(one.step) == int(four.step) == 2
  # One mechanism: the optimizer state is Adam's whatever the count is.
  assert (jax.tree.structure(one.opt_state) ==
          jax.tree.structure(four.opt_state))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5,
                                                       atol=2e-6),
               one.params, four.params)
  assert int(one_metrics['ntokens']) == int(four_metrics['ntokens'])
  np.testing.assert_allclose(one_metrics['loss_sum'],
                             four_metrics['loss_sum'], rtol=1e-5)
  assert float(one_metrics['learning_rate']) == float(
      four_metrics['learning_rate'])


def test_dropout_follows_the_rng_and_the_step(small_copy):
  cfg = small_copy.replace(dropout_rate=0.3)
  step = jax.jit(functools.partial(train_step, config=cfg))
  batch = copy_task.train_batch(cfg, 0)
  state = create_train_state(cfg, jax.random.key(0))
  a, _ = step(state, batch, jax.random.key(1))
  b, _ = step(state, batch, jax.random.key(1))
  c, _ = step(state, batch, jax.random.key(2))
  same = jax.tree.map(np.array_equal, a.params, b.params)
  assert all(jax.tree.leaves(same))
  assert not np.allclose(a.params['shared_embedding']['embed']['embedding'],
                         c.params['shared_embedding']['embed']['embedding'])


def test_eval_step_reports_sums(small_copy):
  state = create_train_state(small_copy, jax.random.key(0))
  batch = copy_task.train_batch(small_copy, 0)
  metrics = eval_step(state.params, batch, small_copy)
  assert int(metrics['ntokens']) == batch.tgt_out.size
  assert 0 <= int(metrics['correct']) <= batch.tgt_out.size
  assert float(metrics['loss_sum']) > 0


@pytest.mark.parametrize('pre_norm, tied', [(False, True), (True, True),
                                            (False, False), (True, False)])
def test_every_variant_learns_the_copy_task(small_copy, train_copy_model,
                                           pre_norm, tied):
  # Plain cross-entropy, whose floor is 0, so that learning shows as a
  # tenfold fall of the loss (the smoothed one falls more slowly).
  cfg = small_copy.replace(pre_norm=pre_norm, share_embeddings=tied,
                           tie_output_embedding=tied, label_smoothing=0.0)
  state, history, exact_match = train_copy_model(cfg)
  assert history[-1]['loss'] < history[0]['loss'] / 10
  match, _, _ = exact_match(state.params, draw=0)
  assert match >= 0.98, (pre_norm, tied, int(state.step), match)


def test_bfloat16_computes_in_bfloat16_and_keeps_float32_state(small_copy):
  cfg = small_copy.replace(dtype='bfloat16')
  state = create_train_state(cfg, jax.random.key(0))
  batch = copy_task.train_batch(cfg, 0)
  logits, inter = Transformer(cfg).apply(
      {'params': state.params}, batch.src, batch.tgt_in, batch.src_mask,
      batch.tgt_mask, mutable=['intermediates'])
  layer = inter['intermediates']['encoder']['layer_0']
  assert layer['after_feed_forward'][0].dtype == jnp.bfloat16
  assert layer['self_attention']['query'][0].dtype == jnp.bfloat16
  assert layer['self_attention']['weights'][0].dtype == jnp.float32  # softmax
  assert logits.dtype == jnp.float32
  full = Transformer(cfg.replace(dtype='float32')).apply(
      {'params': state.params}, batch.src, batch.tgt_in, batch.src_mask,
      batch.tgt_mask)
  np.testing.assert_allclose(logits, full, atol=0.1)
  step = jax.jit(functools.partial(train_step, config=cfg))
  losses_seen = []
  for i in range(30):
    state, metrics = step(state, copy_task.train_batch(cfg, i),
                          jax.random.key(1))
    losses_seen.append(float(metrics['loss_sum'] / metrics['ntokens']))
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(
      (state.params, state.opt_state)) if jnp.issubdtype(leaf.dtype,
                                                         jnp.floating))
  assert np.isfinite(losses_seen).all()
  assert losses_seen[-1] < losses_seen[0]


def _kept_for_backward(cfg, params, batch) -> int:
  """Elements the backward pass keeps (jax's own list of saved residuals)."""
  def loss(params):
    logits = Transformer(cfg).apply(
        {'params': params}, batch.src, batch.tgt_in, batch.src_mask,
        batch.tgt_mask, deterministic=False,
        rngs={'dropout': jax.random.key(1)})
    return losses.label_smoothed_kl(logits, batch.tgt_out, 0.1, cfg.pad_id)[0]

  output = io.StringIO()
  with contextlib.redirect_stdout(output):
    ad_checkpoint.print_saved_residuals(loss, params)
  shapes = re.findall(r'^\w+\[([\d,]*)\]', output.getvalue(), re.MULTILINE)
  assert shapes, output.getvalue()
  return sum(math.prod(int(d) for d in s.split(',') if d) for s in shapes)


def test_remat_recomputes_instead_of_keeping_and_changes_no_number(
    small_copy):
  cfg = small_copy.replace(dropout_rate=0.1, d_ff=256)
  state = create_train_state(cfg, jax.random.key(0))
  batch = copy_task.train_batch(cfg, 0)
  remat = cfg.replace(remat=True)
  # What remat is for: the layers' activations are not kept for the
  # backward pass (only each layer's input is).
  kept, kept_with_remat = (_kept_for_backward(c, state.params, batch)
                           for c in (cfg, remat))
  params = sum(leaf.size for leaf in jax.tree.leaves(state.params))
  assert kept_with_remat - params < 0.5 * (kept - params)
  # And it changes nothing else: same dropout masks, same update.
  steps = [jax.jit(functools.partial(train_step, config=c))(
      state, batch, jax.random.key(1)) for c in (cfg, remat)]
  (plain, plain_metrics), (recomputed, remat_metrics) = steps
  # Equal to float32 rounding: XLA may order the recomputed program's sums
  # differently (one ulp of the loss on jax 0.7.2). The gradients (Adam's
  # first moment) agree closely; the parameters to Adam's first step, which
  # moves each by about the learning rate whatever the gradient's size, so a
  # gradient near epsilon differs a little more there.
  np.testing.assert_allclose(plain_metrics['loss_sum'],
                             remat_metrics['loss_sum'], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-9),
               plain.opt_state[0].mu, recomputed.opt_state[0].mu)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                       atol=1e-6),
               plain.params, recomputed.params)
