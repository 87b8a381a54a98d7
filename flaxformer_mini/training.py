"""The pure training and evaluation steps.

`train_step(state, batch, rng, config) -> (state, metrics)` knows nothing of
devices: jit it for one device; the data-parallel wrappers wrap the same
function from outside. Metrics are sums with their denominator (`ntokens`), so
they add up exactly over steps, devices and hosts.
"""

import flax.training.train_state
import jax
import jax.numpy as jnp

from flaxformer_mini import losses
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.masks import Batch, causal_mask, padding_mask
from flaxformer_mini.model import Transformer
from flaxformer_mini.schedules import learning_rate_schedule, make_optimizer

TrainState = flax.training.train_state.TrainState


def init_params(config: TransformerConfig, rng):
  """Random parameters of Transformer(config); no shape depends on lengths."""
  ids = jnp.full((1, 1), config.bos_id, jnp.int32)
  return Transformer(config).init(
      rng, ids, ids, padding_mask(ids, config.pad_id), causal_mask(1))['params']


def create_train_state(config: TransformerConfig, rng) -> TrainState:
  """Parameters initialised from `rng`, the paper's Adam, step 0."""
  return TrainState.create(apply_fn=Transformer(config).apply,
                           params=init_params(config, rng),
                           tx=make_optimizer(config))


def _loss_and_metrics(params, batch: Batch, config: TransformerConfig,
                      deterministic: bool, dropout_rng=None):
  logits = Transformer(config).apply(
      {'params': params}, batch.src, batch.tgt_in, batch.src_mask,
      batch.tgt_mask, deterministic=deterministic,
      rngs=None if deterministic else {'dropout': dropout_rng})
  loss_sum, ntokens = losses.label_smoothed_kl(
      logits, batch.tgt_out, config.label_smoothing, config.pad_id)
  metrics = {'loss_sum': loss_sum, 'ntokens': ntokens,
             'correct': losses.correct_tokens(logits, batch.tgt_out,
                                              config.pad_id)}
  return loss_sum, metrics


def _micro_batches(batch: Batch, count: int, pad_id: int) -> Batch:
  """batch: [rows, ...] arrays -> `count` micro-batches, [count, rows / count, ...]."""
  split = lambda x: x.reshape((count, x.shape[0] // count) + x.shape[1:])
  tgt_out = split(batch.tgt_out)
  return Batch(src=split(batch.src), tgt_in=split(batch.tgt_in),
               tgt_out=tgt_out, src_mask=split(batch.src_mask),
               tgt_mask=split(batch.tgt_mask),
               ntokens=jnp.sum(tgt_out != pad_id, axis=(1, 2)))


def train_step(state: TrainState, batch: Batch, rng,
               config: TransformerConfig, axis_name: str | None = None):
  """One optimizer update on the mean loss per real target token.

  With config.grad_accumulation = N > 1 the batch is taken as N
  micro-batches of rows / N rows, one after another (a `lax.scan`, so only
  one micro-batch's activations are alive at a time), and their gradients
  are summed: Adam then updates once with the gradient of the whole batch.
  The optimizer state is the same whatever N is, so a run resumes with
  another N (on more or fewer devices) as it is.

  Args:
    state: the TrainState (params, optimizer state, step). The model is
      Transformer(config), as in eval_step, whatever state.apply_fn holds.
    batch: a Batch of [batch, len] arrays (this device's share of the global
      batch when mapped over devices).
    rng: the run's base PRNG key; the dropout key of this step is derived from
      it, the step number and the device index (and the micro-batch), so a
      resumed run draws the same dropout masks and no two devices draw the
      same.
    config: static.
    axis_name: the device axis when the step runs inside shard_map (or pmap);
      gradients and metrics are then summed over it, so the update is that of
      the global batch however it is split.

  Returns:
    (new state, metrics): sums `loss_sum`, `ntokens`, `correct` over the
    global batch, and the `learning_rate` this update used.
  """
  dropout_rng = jax.random.fold_in(rng, state.step)
  if axis_name is not None:
    dropout_rng = jax.random.fold_in(dropout_rng,
                                     jax.lax.axis_index(axis_name))
  grad_fn = jax.grad(_loss_and_metrics, has_aux=True)
  count = config.grad_accumulation
  if count == 1:
    grads, metrics = grad_fn(state.params, batch, config, False, dropout_rng)
  else:
    def micro_step(summed, micro):
      index, micro_batch = micro
      grads, metrics = grad_fn(state.params, micro_batch, config, False,
                               jax.random.fold_in(dropout_rng, index))
      return jax.tree.map(jnp.add, summed, grads), metrics

    grads, metrics = jax.lax.scan(
        micro_step, jax.tree.map(jnp.zeros_like, state.params),
        (jnp.arange(count), _micro_batches(batch, count, config.pad_id)))
    metrics = jax.tree.map(lambda m: m.sum(axis=0), metrics)
  if axis_name is not None:
    grads, metrics = jax.lax.psum((grads, metrics), axis_name)
  # Gradient of the summed loss / tokens = gradient of the per-token mean,
  # the tokens being those of the global batch, every micro-batch included.
  denominator = jnp.maximum(metrics['ntokens'], 1).astype(jnp.float32)
  grads = jax.tree.map(lambda g: g / denominator, grads)
  new_state = state.apply_gradients(grads=grads)
  metrics['learning_rate'] = learning_rate_schedule(config)(state.step)
  return new_state, metrics


def eval_step(params, batch: Batch, config: TransformerConfig,
              axis_name: str | None = None):
  """Loss sums on a batch without dropout.

  params: the model parameters; batch: a Batch of [batch, len] arrays ->
  {loss_sum: float32[], ntokens: int32[], correct: int32[]} (summed over
  `axis_name` where given). Rows of all pad contribute nothing, so a batch
  can be padded to divide over devices without changing the result.
  """
  _, metrics = _loss_and_metrics(params, batch, config, True)
  if axis_name is not None:
    metrics = jax.lax.psum(metrics, axis_name)
  return metrics
