"""Opt-in (`config.cpu_kernels`): two products of the training step written for XLA's CPU.

Nothing here changes a value: each function computes the same product as
the plain model, with a backward pass written out so that XLA's CPU backend
gets the operand layout it runs fastest. The Figure-1 files reach it through
one hook each: every `nn.Dense` takes `dot_general=dot_general_for(config)`,
and the tied output layer calls `attend` where the switch is on.

Why it pays on a CPU (docs/performance.md has the measurements): autodiff
computes a weight gradient dL/dW = x^T . dL/dy as one product contracted over
the tokens, the major axis of both operands, and XLA's CPU matmul runs that
form up to 1.4x slower than the same product with x^T first copied into
[d_in, tokens]. The optimization barrier keeps XLA from folding the copy
back into the product. On a GPU or TPU the copy is only an extra pass over
the activations, so leave the switch off there.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_mini.config import TransformerConfig


def dot_general_for(config: TransformerConfig):
  """The `dot_general` for nn.Dense: this module's where opted in, else Flax's default."""
  return dot_general if config.cpu_kernels else None


def dot_general(x, kernel, dimension_numbers, precision=None,
                preferred_element_type=None):
  """nn.Dense's product: x: float[..., d_in] . kernel: float[d_in, d_out] -> float[..., d_out].

  The product runs in the operands' dtype (nn.Dense casts both to its dtype).
  """
  if dimension_numbers != (((x.ndim - 1,), (0,)), ((), ())):
    raise ValueError(f'dot_general {dimension_numbers}: only the product over '
                     "x's last axis and the kernel's first (nn.Dense's).")
  if preferred_element_type is not None:
    raise ValueError(f'preferred_element_type={preferred_element_type}: the '
                     "product's dtype is the operands' (set config.dtype).")
  rows = x.reshape(-1, x.shape[-1])  # [tokens, d_in]
  return _matmul(rows, kernel, precision).reshape(
      x.shape[:-1] + (kernel.shape[-1],))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, kernel, precision):
  """x: float[tokens, d_in] @ kernel: float[d_in, d_out] -> float[tokens, d_out]."""
  return jnp.matmul(x, kernel, precision=precision)


def _matmul_forward(x, kernel, precision):
  return _matmul(x, kernel, precision), (x, kernel)


def _matmul_backward(precision, residuals, d_y):
  x, kernel = residuals
  d_x = jnp.matmul(d_y, kernel.T, precision=precision)
  x_transposed = jax.lax.optimization_barrier(x.T)  # [d_in, tokens], copied
  return d_x, jnp.matmul(x_transposed, d_y, precision=precision)


_matmul.defvjp(_matmul_forward, _matmul_backward)


def attend(embed: nn.Embed, x):
  """embed.attend(x), the tied pre-softmax layer, through `tied_logits`."""
  x, table = embed.promote_dtype(x, embed.embedding, dtype=embed.dtype)
  return tied_logits(x, table)


@jax.custom_vjp
def tied_logits(x, table):
  """x: float[batch, len, d_model] . table: float[vocab, d_model]^T -> float[batch, len, vocab].

  The tied pre-softmax layer, x @ table.T, with its gradient written out:
  autodiff computes d_table = d_logits^T . x, for which XLA's CPU backend
  first copies the whole [tokens, vocab] gradient into [vocab, tokens];
  (x^T . d_logits)^T transposes [tokens, d_model] and the [d_model, vocab]
  result instead, both far smaller.
  """
  return jnp.einsum('...d,vd->...v', x, table)


def _tied_logits_forward(x, table):
  return tied_logits(x, table), (x, table)


def _tied_logits_backward(residuals, d_logits):
  x, table = residuals
  d_x = jnp.einsum('...v,vd->...d', d_logits, table)
  d_table_t = jnp.einsum('...d,...v->dv', x, d_logits)  # [d_model, vocab]
  return d_x, d_table_t.T


tied_logits.defvjp(_tied_logits_forward, _tied_logits_backward)
