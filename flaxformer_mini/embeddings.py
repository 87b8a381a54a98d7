"""Figure 1's bottom boxes: input/output embeddings and the positional encoding.

Section 3.4: the embedding weights are multiplied by sqrt(d_model); the same
matrix can serve the source, the target and the pre-softmax linear layer.
Section 3.5: sinusoidal positional encodings are added to the embeddings.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini.config import TransformerConfig


class TokenEmbedding(nn.Module):
  """Token ids -> vectors scaled by sqrt(d_model); `attend` gives logits.

  Initialised with std d_model**-0.5 so that the scaled embeddings have unit
  variance, which keeps them on the scale of the positional encodings.
  """
  vocab_size: int
  config: TransformerConfig

  def setup(self):
    self.embed = nn.Embed(
        self.vocab_size, self.config.d_model, dtype=self.config.dtype,
        embedding_init=nn.initializers.normal(self.config.d_model**-0.5))

  def __call__(self, ids):
    """ids: int32[batch, len] -> float32[batch, len, d_model]."""
    return self.embed(ids) * jnp.sqrt(float(self.config.d_model))

  def attend(self, x):
    """The tied pre-softmax layer: x: [batch, len, d_model] -> [batch, len, vocab]."""
    dtype = self.config.dtype
    return tied_logits(x.astype(dtype), self.embed.embedding.astype(dtype))


# Up to this many rows (tokens) the CPU computes the product as table @ x^T.
FEW_ROWS = 64


@jax.custom_vjp
def tied_logits(x, table):
  """x: [batch, len, d_model] times table: [vocab, d_model] transposed.

  -> logits [batch, len, vocab]. The product is x @ table.T; how it is
  computed is chosen for XLA's CPU backend, the values are the same:
  - For a decoding step's few rows (<= FEW_ROWS tokens), on the CPU, the
    product runs as table @ x^T, [vocab, tokens], then is transposed: at a
    few rows XLA's CPU matmul is fast with the large matrix on the left and
    slow with it on the right, where x @ table.T took a third of a `base`
    greedy step (benchmarks/levers.py: table_major_logits). The optimization
    barrier keeps XLA from folding the transpose back into the product.
    Other platforms, not measured, keep x @ table.T.
  - The gradient is written out, to choose which operand gets transposed:
    autodiff computes d_table = d_logits^T . x, for which XLA's CPU backend
    first copies the whole [tokens, vocab] gradient into [vocab, tokens] (a
    tenth of a `small` training step); (x^T . d_logits)^T transposes
    [tokens, d_model] and the [d_model, vocab] result instead
    (benchmarks/levers.py: tied_logits_vjp).
  """
  if math.prod(x.shape[:-1]) > FEW_ROWS:
    return _x_times_table_transposed(x, table)
  return jax.lax.platform_dependent(x, table, cpu=_table_major_product,
                                    default=_x_times_table_transposed)


def _x_times_table_transposed(x, table):
  return jnp.einsum('...d,vd->...v', x, table)


def _table_major_product(x, table):
  tokens = x.reshape(-1, x.shape[-1])  # [tokens, d_model]
  logits_t = jax.lax.optimization_barrier(
      jnp.einsum('vd,nd->vn', table, tokens))  # [vocab, tokens]
  return logits_t.T.reshape(x.shape[:-1] + (table.shape[0],))


def _tied_logits_forward(x, table):
  return tied_logits(x, table), (x, table)


def _tied_logits_backward(residuals, d_logits):
  x, table = residuals
  d_x = jnp.einsum('...v,vd->...d', d_logits, table)
  d_table_t = jnp.einsum('...d,...v->dv', x, d_logits)  # [d_model, vocab]
  return d_x, d_table_t.T


tied_logits.defvjp(_tied_logits_forward, _tied_logits_backward)


def sinusoidal_positions(max_len: int, d_model: int) -> np.ndarray:
  """The paper's table: PE[pos, 2i] = sin(pos / 10000^(2i/d_model)), PE[pos, 2i+1] = cos(...).

  Returns float32[max_len, d_model], sin on even and cos on odd dimensions
  (interleaved, as written in the paper).
  """
  positions = np.arange(max_len, dtype=np.float64)[:, None]
  two_i = np.arange(0, d_model, 2, dtype=np.float64)
  angles = positions / np.power(10000.0, two_i / d_model)
  table = np.zeros((max_len, d_model), dtype=np.float64)
  table[:, 0::2] = np.sin(angles)
  table[:, 1::2] = np.cos(angles[:, : d_model // 2])
  return table.astype(np.float32)


class PositionalEncoding(nn.Module):
  """Adds the sinusoidal encoding of each position to x.

  In decode mode the module sees one token per call, so it keeps the current
  position in the 'cache' collection.
  """
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, decode: bool = False):
    """x: float32[batch, len, d_model] -> float32[batch, len, d_model]."""
    length = x.shape[1]
    if length > self.config.max_len:
      raise ValueError(
          f'sequence length {length} exceeds --max_len={self.config.max_len}.')
    table = jnp.asarray(sinusoidal_positions(self.config.max_len,
                                             self.config.d_model), x.dtype)
    if not decode:
      self.sow('intermediates', 'positional_encoding', table[:length])
      return x + table[None, :length]
    is_initialized = self.has_variable('cache', 'position')
    position = self.variable('cache', 'position',
                             lambda: jnp.zeros((), jnp.int32))
    if not is_initialized:
      # Initialisation runs on the full-length dummy input only to shape the cache.
      return x + table[None, :length]
    index = position.value
    position.value = index + length
    rows = jax.lax.dynamic_slice(table, (index, 0),
                                 (length, self.config.d_model))
    return x + rows[None]
