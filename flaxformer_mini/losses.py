"""The training objective: label smoothing as a KL divergence (Section 5.4).

The model is trained to match a smoothed target distribution q rather than a
one-hot: q puts 1 - eps on the true token, spreads eps evenly over the V - 2
tokens that are neither the true token nor pad, and puts 0 on pad. The loss of
one position is KL(q || p) = sum_v q_v (log q_v - log p_v); with eps = 0 it is
exactly the cross-entropy -log p_true. Pad positions of the target contribute
nothing.
"""

import math

import jax
import jax.numpy as jnp


def smoothed_targets(labels, vocab_size: int, label_smoothing: float,
                     pad_id: int):
  """The distribution q for every position.

  labels: int32[batch, len] -> float32[batch, len, vocab]. Materialises the
  [batch, len, vocab] tensor, so it is for inspection and tests; the loss uses
  the closed form below instead.
  """
  off_value = label_smoothing / (vocab_size - 2) if label_smoothing else 0.0
  one_hot = jax.nn.one_hot(labels, vocab_size, dtype=jnp.float32)
  q = one_hot * (1.0 - label_smoothing) + (1.0 - one_hot) * off_value
  return q.at[..., pad_id].set(0.0)


def _xlogx(x: float) -> float:
  return x * math.log(x) if x > 0 else 0.0


def label_smoothed_kl(logits, labels, label_smoothing: float, pad_id: int):
  """Summed KL(q || softmax(logits)) over the real (non-pad) target tokens.

  Computed from the logits without building q: with lse = logsumexp(logits),
  sum_v q_v log p_v = (1 - eps) log p_true + eps / (V - 2) * sum over the
  tokens v that are neither the truth nor pad of (logits_v - lse), and
  sum_v q_v log q_v is a constant. The pad logit never enters a sum (q puts
  no mass on pad), so any pad logit, -1e9 or -inf included, gives the same
  value.

  Args:
    logits: float[batch, len, vocab] (upcast to float32 here).
    labels: int32[batch, len], pad where there is no token.
    label_smoothing: eps in [0, 1).
    pad_id: the padding id.

  Returns:
    (loss_sum: float32[], ntokens: int32[]); the mean loss is their ratio.
  """
  vocab_size = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  log_p_true = jnp.take_along_axis(logits, labels[..., None],
                                   axis=-1)[..., 0] - lse
  confidence = 1.0 - label_smoothing
  cross = confidence * log_p_true
  if label_smoothing:
    off_value = label_smoothing / (vocab_size - 2)
    others = (jnp.arange(vocab_size) != pad_id) & (
        jnp.arange(vocab_size) != labels[..., None])
    sum_others = jnp.sum(jnp.where(others, logits, 0.0), axis=-1)
    cross += off_value * (sum_others - (vocab_size - 2) * lse)
    neg_entropy = _xlogx(confidence) + (vocab_size - 2) * _xlogx(off_value)
  else:
    neg_entropy = 0.0
  real = labels != pad_id
  loss_sum = jnp.sum(jnp.where(real, neg_entropy - cross, 0.0))
  return loss_sum, jnp.sum(real).astype(jnp.int32)


def correct_tokens(logits, labels, pad_id: int):
  """How many real target tokens get the largest logit: -> int32[].

  logits: float[batch, len, vocab]; labels: int32[batch, len]. The true
  token's logit is compared with the maximum, which the loss's logsumexp
  computes anyway; a tie for the largest logit counts as correct.
  """
  real = labels != pad_id
  true_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  ranked_first = true_logit >= jnp.max(logits, axis=-1)
  return jnp.sum(ranked_first & real).astype(jnp.int32)
