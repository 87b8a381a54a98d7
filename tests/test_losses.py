import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_mini import losses

PAD, VOCAB = 0, 7


def _logits_and_labels():
  logits = jax.random.normal(jax.random.key(0), (2, 4, VOCAB)) * 3
  labels = jnp.array([[3, 4, 5, PAD], [6, 2, PAD, PAD]])
  return logits, labels


@pytest.mark.parametrize('eps', [0.0, 0.1, 0.4])
def test_smoothed_target_sums_to_one_and_is_zero_on_pad(eps):
  _, labels = _logits_and_labels()
  q = np.asarray(losses.smoothed_targets(labels, VOCAB, eps, PAD))
  real = np.asarray(labels) != PAD
  np.testing.assert_allclose(q.sum(-1)[real], 1.0, rtol=1e-6)
  assert np.all(q[..., PAD] == 0.0)
  np.testing.assert_allclose(
      np.take_along_axis(q, np.asarray(labels)[..., None], -1)[..., 0][real],
      1.0 - eps, rtol=1e-6)


@pytest.mark.parametrize('eps', [0.1, 0.4])
def test_closed_form_equals_kl_to_the_smoothed_target(eps):
  logits, labels = _logits_and_labels()
  q = losses.smoothed_targets(labels, VOCAB, eps, PAD)
  log_p = jax.nn.log_softmax(logits)
  kl = jnp.sum(jnp.where(q > 0, q * (jnp.log(jnp.where(q > 0, q, 1)) - log_p),
                         0.0), axis=-1)
  expected = jnp.sum(jnp.where(labels != PAD, kl, 0.0))
  loss_sum, ntokens = losses.label_smoothed_kl(logits, labels, eps, PAD)
  np.testing.assert_allclose(loss_sum, expected, rtol=1e-5)
  assert int(ntokens) == 5


def test_kl_equals_cross_entropy_without_smoothing():
  logits, labels = _logits_and_labels()
  loss_sum, ntokens = losses.label_smoothed_kl(logits, labels, 0.0, PAD)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  expected = jnp.sum(jnp.where(labels != PAD, ce, 0.0))
  np.testing.assert_allclose(loss_sum, expected, rtol=1e-6)
  assert int(ntokens) == 5


def test_pad_positions_contribute_nothing():
  logits, labels = _logits_and_labels()
  base, _ = losses.label_smoothed_kl(logits, labels, 0.1, PAD)
  scrambled = logits.at[0, 3].set(100.0).at[1, 2:].set(-50.0)
  changed, _ = losses.label_smoothed_kl(scrambled, labels, 0.1, PAD)
  assert float(changed) == float(base)


def test_loss_is_finite_and_zero_at_the_target_distribution():
  _, labels = _logits_and_labels()
  q = losses.smoothed_targets(labels, VOCAB, 0.1, PAD)
  # log q is -inf on pad: the loss must stay finite regardless.
  loss_sum, _ = losses.label_smoothed_kl(jnp.log(q + 1e-30), labels, 0.1, PAD)
  assert np.isfinite(float(loss_sum))
  np.testing.assert_allclose(loss_sum, 0.0, atol=1e-4)


def test_correct_tokens_counts_only_real_tokens():
  labels = jnp.array([[3, 4, PAD]])
  logits = jax.nn.one_hot(jnp.array([[3, 5, PAD]]), VOCAB)
  assert int(losses.correct_tokens(logits, labels, PAD)) == 1


def test_correct_tokens_agrees_with_argmax_without_ties():
  logits, labels = _logits_and_labels()
  real = labels != PAD
  expected = jnp.sum((jnp.argmax(logits, axis=-1) == labels) & real)
  # Plant some hits: the label gets the largest logit at every other position.
  planted = jnp.where(
      (jnp.arange(labels.shape[-1]) % 2 == 0)[..., None] &
      (jnp.arange(VOCAB) == labels[..., None]), 100.0, logits)
  planted_expected = jnp.sum((jnp.argmax(planted, axis=-1) == labels) & real)
  assert int(losses.correct_tokens(logits, labels, PAD)) == int(expected)
  assert int(losses.correct_tokens(planted, labels, PAD)) == int(
      planted_expected) > 0


@pytest.mark.parametrize('pad_logit', [-1e9, -jnp.inf, 30.0])
def test_any_pad_logit_gives_the_same_loss_and_a_finite_gradient(pad_logit):
  # q puts no mass on pad, so the KL cannot depend on the pad logit: a model
  # that masks pad out of its logits (-1e9 or -inf) gets the true value, not
  # a negative "KL" or a NaN.
  logits, labels = _logits_and_labels()
  q = losses.smoothed_targets(labels, VOCAB, 0.1, PAD)
  masked = logits.at[..., PAD].set(pad_logit)
  # The reference: KL(q || p) with p renormalised over the non-pad tokens,
  # which is what the model's distribution is once pad has no mass.
  log_p = jax.nn.log_softmax(jnp.where(jnp.arange(VOCAB) == PAD, -jnp.inf,
                                       logits))
  kl = jnp.sum(jnp.where(q > 0, q * (jnp.log(jnp.where(q > 0, q, 1)) - log_p),
                         0.0), axis=-1)
  loss_sum, _ = losses.label_smoothed_kl(masked, labels, 0.1, PAD)
  if pad_logit < 0:
    np.testing.assert_allclose(loss_sum, jnp.sum(jnp.where(labels != PAD, kl,
                                                           0.0)), rtol=1e-5)
  assert float(loss_sum) >= 0.0
  gradient = jax.grad(lambda x: losses.label_smoothed_kl(x, labels, 0.1,
                                                         PAD)[0])(masked)
  assert np.all(np.isfinite(np.asarray(gradient)))
