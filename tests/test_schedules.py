import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini.config import get_config
from flaxformer_mini.schedules import (learning_rate_schedule, make_optimizer,
                                       noam_schedule)


def _closed_form(step, d_model, warmup, factor):
  return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def test_noam_matches_the_closed_form_with_its_peak_at_warmup():
  d_model, warmup, factor = 512, 4000, 1.0
  schedule = noam_schedule(d_model, warmup, factor)
  for step in (1, 10, 100, 3999, 4000, 4001, 10_000, 100_000):
    np.testing.assert_allclose(schedule(step - 1),
                               _closed_form(step, d_model, warmup, factor),
                               rtol=1e-5)
  rates = np.asarray(jax.vmap(schedule)(jnp.arange(20_000)))
  assert int(np.argmax(rates)) + 1 == warmup
  np.testing.assert_allclose(rates.max(), (d_model * warmup)**-0.5, rtol=1e-5)


def test_schedule_is_finite_and_positive_at_step_zero():
  value = float(noam_schedule(8, 400, 2.0)(0))
  assert np.isfinite(value) and value > 0


def test_optimizer_is_adam_with_the_papers_betas_and_schedule():
  cfg = get_config('toy')
  params = {'w': jnp.zeros(3)}
  gradients = [np.array([0.5, -1.0, 2.0]), np.array([-0.3, 0.1, 4.0]),
               np.array([1.0, 1.0, -1.0])]
  optimizer = make_optimizer(cfg)
  state = optimizer.init(params)
  m = v = np.zeros(3)
  for t, g in enumerate(gradients, start=1):
    update, state = optimizer.update({'w': jnp.asarray(g)}, state)
    # Adam by hand, with beta1 = 0.9, beta2 = 0.98, epsilon = 1e-9.
    m = 0.9 * m + 0.1 * g
    v = 0.98 * v + 0.02 * g**2
    m_hat, v_hat = m / (1 - 0.9**t), v / (1 - 0.98**t)
    lr = _closed_form(t, cfg.d_model, cfg.warmup_steps, cfg.lr_factor)
    np.testing.assert_allclose(update['w'],
                               -lr * m_hat / (np.sqrt(v_hat) + 1e-9),
                               rtol=1e-5)


def test_cooldown_takes_the_rate_linearly_to_zero_over_the_last_steps():
  cfg = get_config('toy').replace(train_steps=1000, warmup_steps=100,
                                  cooldown_steps=200)
  noam = noam_schedule(cfg.d_model, cfg.warmup_steps, cfg.lr_factor)
  schedule = learning_rate_schedule(cfg)
  for count in (0, 99, 500, 799):  # before the cooldown: the paper's rate
    np.testing.assert_allclose(schedule(count), noam(count), rtol=1e-6)
  for count in (800, 900, 950, 999):
    np.testing.assert_allclose(schedule(count),
                               noam(count) * (1000 - count) / 200, rtol=1e-5)
  assert float(schedule(999)) > 0 and float(schedule(1000)) == 0
  rates = np.asarray(jax.vmap(schedule)(jnp.arange(800, 1000)))
  assert np.all(np.diff(rates) < 0)


def test_no_cooldown_is_the_papers_schedule():
  cfg = get_config('toy').replace(train_steps=1000, warmup_steps=100)
  noam = noam_schedule(cfg.d_model, cfg.warmup_steps, cfg.lr_factor)
  counts = jnp.arange(1000)
  np.testing.assert_array_equal(jax.vmap(learning_rate_schedule(cfg))(counts),
                                jax.vmap(noam)(counts))
