"""Products and moves in the forms XLA's CPU backend runs fastest, with the plain forms' values.

Opt-in (`config.cpu_kernels`): two products of the training step, with a
backward pass written out so that XLA's CPU backend gets the operand layout
it runs fastest. Why it pays on a CPU (docs/performance.md has the
measurements): autodiff computes a weight gradient dL/dW = x^T . dL/dy as
one product contracted over the tokens, the major axis of both operands,
and XLA's CPU matmul runs that form up to 1.4x slower than the same product
with x^T first copied into [d_in, tokens]. The optimization barrier keeps
XLA from folding the copy back into the product. On a GPU or TPU the copy
is only an extra pass over the activations, so leave the switch off there.

Always, in a 16-bit dtype (config.dtype bfloat16): every product
accumulates in float32 and is rounded once (`accumulated_in_float32` for
nn.Dense, `product` for the attention's products and the tied logits), and
the search's key/value cache is written and reordered as bits (`as_bits`).
XLA's CPU backend computes a bfloat16 product in float32 anyway and has no
bfloat16 gather or scatter, so both are the values it gave before; asked
this way it runs the products on the CPU's bfloat16 units (AMX or AVX-512
BF16 where it has them) and moves the cache without converting it: a
bfloat16 beam search 1.5x faster than float32 on this project's hosts,
where it was slower. On a GPU or TPU, where products accumulate in float32
too, they are the same. Before jax 0.10 (`result_dtype`) the products keep
their operands' dtype, as Flax's default.

The Figure-1 files reach this module through one hook each: every
`nn.Dense` takes `dot_general=dot_general_for(config)`, the tied output
layer calls `tied_logits` where the switch is on (else `float32_logits`),
the attention's products are `product`s, and the cache's write calls
`as_bits`.
"""

import functools

import jax
import jax.numpy as jnp

from flaxformer_mini.config import TransformerConfig


# Before jax 0.10 XLA's CPU backend cannot run a bfloat16 product that
# returns float32 (UNIMPLEMENTED in its DotThunk, measured on jax 0.7.2):
# there a product returns its operands' dtype, as Flax's default does.
_FLOAT32_RESULTS = jax.__version_info__ >= (0, 10)


def result_dtype(*operands):
  """The dtype a product of `operands` returns: float32 where this JAX can
  (the accumulator's), else the operands' own."""
  return jnp.float32 if _FLOAT32_RESULTS else jnp.result_type(*operands)


def dot_general_for(config: TransformerConfig):
  """The `dot_general` for nn.Dense: this module's where opted in; else, in a
  16-bit dtype, `accumulated_in_float32`; else Flax's default."""
  if config.cpu_kernels:
    return dot_general
  return None if config.dtype == 'float32' else accumulated_in_float32


def accumulated_in_float32(x, kernel, dimension_numbers, precision=None,
                           preferred_element_type=None):
  """jax.lax.dot_general accumulated in float32 and returned in the operands'
  dtype: nn.Dense's product in a 16-bit dtype (why: `product`)."""
  del preferred_element_type  # the operands' dtype, as Flax's default
  return jax.lax.dot_general(
      x, kernel, dimension_numbers, precision=precision,
      preferred_element_type=result_dtype(x, kernel)).astype(
          jnp.result_type(x, kernel))


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


def product(spec: str, a, b, precision=None, dtype=None):
  """jnp.einsum(spec, a, b) accumulated in float32 where this JAX can
  (`result_dtype`), returned in `dtype` (default: a and b's).

  XLA's CPU backend computes a bfloat16 product in float32 anyway (it has
  no bfloat16 matmul of its own); asked for the float32 result, it hands
  the product to YNNPACK's bfloat16 kernels instead: 5-10x a float32
  product on this project's hosts, where the bfloat16 result took longer
  than float32 (docs/performance.md). For float32 operands it is the
  plain product.
  """
  return jnp.einsum(spec, a, b, precision=precision,
                    preferred_element_type=result_dtype(a, b)).astype(
                        dtype or jnp.result_type(a, b))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, kernel, precision):
  """x: float[tokens, d_in] @ kernel: float[d_in, d_out] -> float[tokens, d_out]."""
  return product('td,de->te', x, kernel, precision)


def _matmul_forward(x, kernel, precision):
  return _matmul(x, kernel, precision), (x, kernel)


def _matmul_backward(precision, residuals, d_y):
  x, kernel = residuals
  d_x = product('te,de->td', d_y, kernel, precision)
  x_transposed = jax.lax.optimization_barrier(x.T)  # [d_in, tokens], copied
  return d_x, product('dt,te->de', x_transposed, d_y, precision)


_matmul.defvjp(_matmul_forward, _matmul_backward)


@jax.custom_vjp
def tied_logits(x, table):
  """x: float[batch, len, d_model] . table: float[vocab, d_model]^T -> float32[batch, len, vocab].

  The tied pre-softmax layer, x @ table.T, accumulated and returned in
  float32 (as `float32_logits`), with its gradient
  written out:
  autodiff computes d_table = d_logits^T . x, for which XLA's CPU backend
  first copies the whole [tokens, vocab] gradient into [vocab, tokens];
  (x^T . d_logits)^T transposes [tokens, d_model] and the [d_model, vocab]
  result instead, both far smaller.
  """
  return float32_logits(x, table)


def float32_logits(x, table):
  """x: float[..., d_model] . table: float[vocab, d_model]^T ->
  float32[..., vocab], accumulated in float32 where this JAX can
  (`result_dtype`): the tied pre-softmax layer's product, plain or through
  `tied_logits`."""
  return product('...d,vd->...v', x, table, dtype=jnp.float32)


def _tied_logits_forward(x, table):
  return tied_logits(x, table), (x, table)


def _tied_logits_backward(residuals, d_logits):
  x, table = residuals
  d_logits = d_logits.astype(x.dtype)  # the operands' precision
  d_x = product('...v,vd->...d', d_logits, table)
  d_table_t = product('...d,...v->dv', x, d_logits)  # [d_model, vocab]
  return d_x, d_table_t.T


tied_logits.defvjp(_tied_logits_forward, _tied_logits_backward)


def as_bits(move):
  """move(x, *args), a function that only moves x's elements (a gather, a
  scatter of rows), run on x's bits where x is 16-bit floats: -> the same
  array, bit for bit.

  XLA's CPU backend has no bfloat16 gather or scatter: it converts the
  whole operand to float32 and back around each one, which in a bfloat16
  beam search costs more than the move (the key/value cache written and
  reordered at every step). Moved as uint16 they are plain copies. The
  first operand of any other dtype is moved as it is.
  """
  def moved(x, *args):
    if not (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2):
      return move(x, *args)
    args = [jax.lax.bitcast_convert_type(a, jnp.uint16)
            if getattr(a, 'dtype', None) == x.dtype else a for a in args]
    return jax.lax.bitcast_convert_type(
        move(jax.lax.bitcast_convert_type(x, jnp.uint16), *args), x.dtype)
  return moved
