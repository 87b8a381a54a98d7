"""Figure 1's bottom boxes: input/output embeddings and the positional encoding.

Section 3.4: the embedding weights are multiplied by sqrt(d_model); the same
matrix can serve the source, the target and the pre-softmax linear layer.
Section 3.5: sinusoidal positional encodings are added to the embeddings.
"""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from flaxformer_mini import cpu_kernels
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
    """ids: int32[batch, len] -> dtype[batch, len, d_model] (dtype: config.dtype)."""
    return self.embed(ids) * jnp.sqrt(float(self.config.d_model))

  def attend(self, x):
    """The tied pre-softmax layer: x: dtype[batch, len, d_model] -> float32[batch, len, vocab].

    The product accumulates in float32 and its logits stay float32 whatever
    the dtype: the loss and the search's log_softmax take them so, and
    rounding them to bfloat16 first would lose what they tell apart.
    """
    x, table = self.embed.promote_dtype(x, self.embed.embedding,
                                        dtype=self.embed.dtype)
    # cpu_kernels: the same logits, with the gradient XLA's CPU runs fastest.
    logits = (cpu_kernels.tied_logits if self.config.cpu_kernels else
              cpu_kernels.float32_logits)
    return logits(x, table)


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
  """Adds the sinusoidal encoding of each token's position to x.

  The positions come from the stack (model.py), which counts them once for
  the positional encoding and the key/value cache alike.
  """
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, positions):
    """x: dtype[batch, len, d_model]; positions: int32[batch, len] -> dtype[batch, len, d_model]."""
    table = jnp.asarray(sinusoidal_positions(self.config.max_len,
                                             self.config.d_model), x.dtype)
    encoding = jnp.take(table, positions, axis=0)
    self.sow('intermediates', 'encoding', encoding)
    return x + encoding


def positions_of(batch: int, length: int, max_len: int, start=0):
  """The positions of `length` tokens from `start` on: -> int32[batch, length].

  start: int32[batch] (or a scalar): each row's first position. A sequence
  longer than max_len (the positional table) is refused.
  """
  if length > max_len:
    raise ValueError(f'sequence length {length} exceeds config.max_len='
                     f'{max_len}.')
  start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch,))
  return start[:, None] + jnp.arange(length, dtype=jnp.int32)[None]
