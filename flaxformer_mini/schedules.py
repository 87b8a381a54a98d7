"""Section 5.3: Adam with the warm-up / inverse-square-root ("Noam") schedule.

`cooldown_steps` (0 in the paper) ends the schedule with a linear decay to 0
over the run's last steps, as warm-up / stable / decay schedules do: a run of
a known length ends on the annealed parameters instead of on a rate that is
still far from 0. Averaging the last checkpoints reaches the same end another
way (docs/multi30k.md, run 13).
"""

import jax.numpy as jnp
import optax

from flaxformer_mini.config import TransformerConfig


def noam_schedule(d_model: int, warmup_steps: int,
                  factor: float = 1.0) -> optax.Schedule:
  """lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

  optax counts updates from 0; the paper's step numbers start at 1, so the
  schedule evaluates the formula at step = count + 1. That keeps it finite at
  count 0 and puts the peak, factor * (d_model * warmup)^-0.5, at count + 1 ==
  warmup_steps.
  """
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return factor * d_model**-0.5 * jnp.minimum(step**-0.5,
                                                step * warmup_steps**-1.5)
  return schedule


def with_cooldown(schedule: optax.Schedule, train_steps: int,
                  cooldown_steps: int) -> optax.Schedule:
  """`schedule` times a ramp from 1 down to 0 over the last `cooldown_steps`.

  The update of count c (step c + 1) is scaled by
  min(1, (train_steps - c) / cooldown_steps): the first update of the
  cooldown keeps its full rate and the last one, count train_steps - 1,
  takes 1 / cooldown_steps of it.
  """
  if not cooldown_steps:
    return schedule
  ramp = optax.linear_schedule(1.0, 0.0, transition_steps=cooldown_steps,
                               transition_begin=train_steps - cooldown_steps)
  return lambda count: schedule(count) * ramp(count)


def learning_rate_schedule(config: TransformerConfig) -> optax.Schedule:
  return with_cooldown(
      noam_schedule(config.d_model, config.warmup_steps, config.lr_factor),
      config.train_steps, config.cooldown_steps)


def make_optimizer(config: TransformerConfig) -> optax.GradientTransformation:
  """The paper's Adam: beta1 = 0.9, beta2 = 0.98, epsilon = 1e-9.

  Gradient accumulation is the training step's (train_step sums the
  micro-batches' gradients), so this state is the same whatever
  config.grad_accumulation is.
  """
  return optax.adam(learning_rate_schedule(config), b1=0.9, b2=0.98, eps=1e-9)
