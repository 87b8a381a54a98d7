"""The learned linear maps of every box: y = x W + b over the last axis.

Each is a flax nn.Dense (parameters `kernel` [d_in, d_out] and `bias`
[d_out]) whose product has its weight gradient written out. Autodiff computes
dL/dW = x^T . dL/dy as one product contracted over the tokens, the major axis
of both operands; XLA's CPU backend runs that form up to 1.4x slower than the
same product with x^T first copied into [d_in, tokens] (a copy of the
activations, a small fraction of the product's work). Written out, the whole
training step runs about 1.1x faster on the CPU (benchmarks/levers.py:
dense_weight_gradient); other platforms keep autodiff's product. The values
are the same products either way.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_mini.config import TransformerConfig


def dense(features: int, config: TransformerConfig, name: str | None = None,
          use_bias: bool = True) -> nn.Dense:
  """nn.Dense(features) in config.dtype, with `dot_general` below."""
  return nn.Dense(features, use_bias=use_bias, dtype=config.dtype,
                  dot_general=dot_general, name=name)


def dot_general(x, kernel, dimension_numbers, precision=None,
                preferred_element_type=None):
  """nn.Dense's product: x: [..., d_in] . kernel: [d_in, d_out] -> [..., d_out].

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
  """x: [tokens, d_in] @ kernel: [d_in, d_out] -> [tokens, d_out]."""
  return jnp.matmul(x, kernel, precision=precision)


def _matmul_forward(x, kernel, precision):
  return _matmul(x, kernel, precision), (x, kernel)


def _matmul_backward(precision, residuals, d_y):
  x, kernel = residuals
  d_x = jnp.matmul(d_y, kernel.T, precision=precision)
  kernel_gradient = functools.partial(_kernel_gradient, precision=precision)
  # Only XLA's CPU backend is known to gain; elsewhere the copy would be an
  # extra pass over the activations, so accelerators get autodiff's product.
  d_kernel = jax.lax.platform_dependent(
      x, d_y, cpu=functools.partial(kernel_gradient, copy_x_transposed=True),
      default=functools.partial(kernel_gradient, copy_x_transposed=False))
  return d_x, d_kernel


def _kernel_gradient(x, d_y, precision, copy_x_transposed: bool):
  """x: [tokens, d_in], d_y: [tokens, d_out] -> x^T d_y: [d_in, d_out]."""
  x_transposed = x.T
  if copy_x_transposed:
    # The barrier keeps XLA from folding the transpose back into a product
    # contracted over the tokens.
    x_transposed = jax.lax.optimization_barrier(x_transposed)
  return jnp.matmul(x_transposed, d_y, precision=precision)


_matmul.defvjp(_matmul_forward, _matmul_backward)
