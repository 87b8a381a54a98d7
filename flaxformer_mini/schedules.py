"""Section 5.3: Adam with the warm-up / inverse-square-root ("Noam") schedule."""

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


def learning_rate_schedule(config: TransformerConfig) -> optax.Schedule:
  return noam_schedule(config.d_model, config.warmup_steps, config.lr_factor)


def make_optimizer(config: TransformerConfig) -> optax.GradientTransformation:
  """The paper's Adam: beta1 = 0.9, beta2 = 0.98, epsilon = 1e-9."""
  return optax.adam(learning_rate_schedule(config), b1=0.9, b2=0.98, eps=1e-9)
