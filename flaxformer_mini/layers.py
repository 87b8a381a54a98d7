"""Figure 1's layers: the feed-forward block, Add & Norm, encoder and decoder layers.

Section 3.1: each sublayer is wrapped as LayerNorm(x + Dropout(Sublayer(x)))
(post-norm, the paper's choice). `pre_norm=True` switches to the common
alternative x + Dropout(Sublayer(LayerNorm(x))), which trains more stably in
deep stacks; the stacks then end with a final LayerNorm (see model.py).

Shapes: dtype is config.dtype (float32, or bfloat16 for mixed precision).
"""

import functools
from typing import Callable

import flax.linen as nn

from flaxformer_mini import cpu_kernels
from flaxformer_mini.attention import MultiHeadAttention
from flaxformer_mini.config import TransformerConfig


class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2, applied to each position alike.

  x: dtype[batch, len, d_model] -> dtype[batch, len, d_model], through
  dtype[batch, len, d_ff].
  """
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    cfg = self.config
    dense = functools.partial(nn.Dense, dtype=cfg.dtype,
                              dot_general=cpu_kernels.dot_general_for(cfg))
    hidden = nn.relu(dense(cfg.d_ff, name='wi')(x))
    self.sow('intermediates', 'hidden', hidden)
    hidden = nn.Dropout(cfg.relu_dropout_rate)(hidden,
                                               deterministic=deterministic)
    output = dense(cfg.d_model, name='wo')(hidden)
    self.sow('intermediates', 'output', output)
    return output


class AddAndNorm(nn.Module):
  """The residual connection and layer norm around one sublayer.

  x: dtype[batch, len, d_model]; `sublayer` maps it to the same shape.
  """
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, sublayer: Callable, deterministic: bool = True):
    # Statistics are computed in float32 even when dtype is bfloat16.
    norm = nn.LayerNorm(epsilon=self.config.layer_norm_epsilon,
                        dtype=self.config.dtype)
    dropout = nn.Dropout(self.config.dropout_rate)
    if self.config.pre_norm:
      return x + dropout(sublayer(norm(x)), deterministic=deterministic)
    return norm(x + dropout(sublayer(x), deterministic=deterministic))


class EncoderLayer(nn.Module):
  """Self-attention, then feed-forward, each wrapped in Add & Norm."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, src_mask, deterministic: bool = True):
    """x: dtype[batch, src_len, d_model]; src_mask: bool[batch, 1, 1, src_len].

    Returns dtype[batch, src_len, d_model].
    """
    self_attention = MultiHeadAttention(self.config, name='self_attention')
    feed_forward = FeedForward(self.config, name='feed_forward')
    x = AddAndNorm(self.config, name='self_attention_norm')(
        x, lambda y: self_attention(y, y, src_mask, deterministic),
        deterministic)
    self.sow('intermediates', 'after_self_attention', x)
    x = AddAndNorm(self.config, name='feed_forward_norm')(
        x, lambda y: feed_forward(y, deterministic), deterministic)
    self.sow('intermediates', 'after_feed_forward', x)
    return x


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention, then feed-forward.

  In the second attention block the queries come from the decoder and the keys
  and values from the encoder output: that is how each target position looks
  at the source sentence. Every decoder layer reads the same, final encoder
  output.
  """
  config: TransformerConfig

  @nn.compact
  def __call__(self, y, encoded, src_mask, tgt_mask, deterministic: bool = True,
               incremental: bool = False, positions=None):
    """One decoder layer.

    Args:
      y: dtype[batch, tgt_len, d_model], the decoder's running representation.
      encoded: dtype[batch, src_len, d_model], the encoder output.
      src_mask: bool[batch, 1, 1, src_len].
      tgt_mask: bool[batch, 1, tgt_len, tgt_len] (unused in incremental
        decoding, where the key/value cache supplies the causal mask).
      deterministic: disables dropout.
      incremental: process only the new token(s), using the cache.
      positions: int32[batch, tgt_len], the tokens' positions (where the
        cache writes them; incremental only).

    Returns:
      dtype[batch, tgt_len, d_model].
    """
    self_attention = MultiHeadAttention(self.config, name='self_attention')
    cross_attention = MultiHeadAttention(self.config, cross_attention=True,
                                         name='cross_attention')
    feed_forward = FeedForward(self.config, name='feed_forward')
    y = AddAndNorm(self.config, name='self_attention_norm')(
        y, lambda z: self_attention(z, z, tgt_mask, deterministic,
                                    incremental, positions),
        deterministic)
    self.sow('intermediates', 'after_self_attention', y)
    y = AddAndNorm(self.config, name='cross_attention_norm')(
        y, lambda z: cross_attention(z, encoded, src_mask, deterministic,
                                     incremental),
        deterministic)
    self.sow('intermediates', 'after_cross_attention', y)
    y = AddAndNorm(self.config, name='feed_forward_norm')(
        y, lambda z: feed_forward(z, deterministic), deterministic)
    self.sow('intermediates', 'after_feed_forward', y)
    return y
