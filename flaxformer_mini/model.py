"""Figure 1 as a whole: the encoder stack, the decoder stack, the Transformer.

`Transformer.encode` and `Transformer.decode` are separate so that decoding
runs the encoder once and then the decoder one token at a time.

Shapes: dtype is config.dtype (float32, or bfloat16 for mixed precision).
"""

import flax.linen as nn
import jax.numpy as jnp

from flaxformer_mini import cpu_kernels
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.embeddings import (PositionalEncoding, TokenEmbedding,
                                       positions_of)
from flaxformer_mini.layers import DecoderLayer, EncoderLayer


class Encoder(nn.Module):
  """Embedding + positions, then N encoder layers (the left half of Figure 1)."""
  config: TransformerConfig
  embedding: TokenEmbedding

  @nn.compact
  def __call__(self, src, src_mask, deterministic: bool = True):
    """src: int32[batch, src_len]; src_mask: bool[batch, 1, 1, src_len].

    Returns the encoder output: dtype[batch, src_len, d_model].
    """
    cfg = self.config
    tokens = self.embedding(src)
    self.sow('intermediates', 'token_embedding', tokens)
    positions = positions_of(*src.shape, cfg.max_len)
    x = PositionalEncoding(cfg, name='positional_encoding')(tokens, positions)
    self.sow('intermediates', 'embedded', x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    # remat: recompute each layer in the backward pass instead of keeping its
    # activations; `deterministic` (argument 3, counting self) is static.
    layer = (nn.remat(EncoderLayer, static_argnums=(3,)) if cfg.remat else
             EncoderLayer)
    for i in range(cfg.num_encoder_layers):
      x = layer(cfg, name=f'layer_{i}')(x, src_mask, deterministic)
    if cfg.pre_norm:
      x = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype,
                       name='final_norm')(x)
    return x


class Decoder(nn.Module):
  """Embedding + positions, then N decoder layers (the right half of Figure 1)."""
  config: TransformerConfig
  embedding: TokenEmbedding

  @nn.compact
  def __call__(self, tgt_in, encoded, src_mask, tgt_mask,
               deterministic: bool = True, incremental: bool = False):
    """tgt_in: int32[batch, tgt_len] -> dtype[batch, tgt_len, d_model].

    encoded: dtype[batch, src_len, d_model]; src_mask: bool[batch, 1, 1,
    src_len]; tgt_mask: bool[batch, 1, tgt_len, tgt_len], or None in
    incremental decoding.
    """
    cfg = self.config
    tokens = self.embedding(tgt_in)
    self.sow('intermediates', 'token_embedding', tokens)
    positions = self._positions(*tgt_in.shape, incremental)
    y = PositionalEncoding(cfg, name='positional_encoding')(tokens, positions)
    self.sow('intermediates', 'embedded', y)
    y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    # Arguments 5 and 6 (deterministic, incremental) are static; decoding has
    # no backward pass, so nothing to recompute there.
    layer = (nn.remat(DecoderLayer, static_argnums=(5, 6))
             if cfg.remat and not incremental else DecoderLayer)
    for i in range(cfg.num_decoder_layers):
      y = layer(cfg, name=f'layer_{i}')(
          y, encoded, src_mask, tgt_mask, deterministic, incremental,
          positions)
    if cfg.pre_norm:
      y = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype,
                       name='final_norm')(y)
    return y

  def _positions(self, batch: int, length: int, incremental: bool):
    """The positions of the tokens fed now: int32[batch, length].

    A full pass starts at 0. In incremental decoding the decoder counts
    each row's tokens fed so far in the 'cache' collection (int32[batch]),
    the one counter of a search's position: the positional encoding and
    every layer's key/value cache read the positions given here.
    """
    if not incremental:
      return positions_of(batch, length, self.config.max_len)
    is_initialized = self.has_variable('cache', 'position')
    fed = self.variable('cache', 'position',
                        lambda: jnp.zeros((batch,), jnp.int32))
    if not is_initialized:
      # Initialisation sees the full-length dummy input: it sizes the cache.
      return positions_of(batch, length, self.config.max_len)
    positions = positions_of(batch, length, self.config.max_len, fed.value)
    fed.value = fed.value + length
    return positions


class Transformer(nn.Module):
  """The encoder-decoder Transformer of "Attention Is All You Need"."""
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    if cfg.share_embeddings:
      source_embedding = target_embedding = TokenEmbedding(
          cfg.src_vocab_size, cfg, name='shared_embedding')
    else:
      source_embedding = TokenEmbedding(cfg.src_vocab_size, cfg,
                                        name='source_embedding')
      target_embedding = TokenEmbedding(cfg.tgt_vocab_size, cfg,
                                        name='target_embedding')
    self.target_embedding = target_embedding
    self.encoder = Encoder(cfg, source_embedding)
    self.decoder = Decoder(cfg, target_embedding)
    if not cfg.tie_output_embedding:
      self.output_projection = nn.Dense(
          cfg.tgt_vocab_size, dtype=cfg.dtype,
          dot_general=cpu_kernels.dot_general_for(cfg))

  def encode(self, src, src_mask, deterministic: bool = True):
    """src: int32[batch, src_len] -> dtype[batch, src_len, d_model]."""
    return self.encoder(src, src_mask, deterministic)

  def decode(self, encoded, src_mask, tgt_in, tgt_mask=None,
             deterministic: bool = True, incremental: bool = False):
    """The decoder stack and the final linear layer.

    Args:
      encoded: dtype[batch, src_len, d_model], from `encode`.
      src_mask: bool[batch, 1, 1, src_len].
      tgt_in: int32[batch, tgt_len] (tgt_len = 1 per step when incremental).
      tgt_mask: bool[batch, 1, tgt_len, tgt_len]; None when incremental.
      deterministic: disables dropout.
      incremental: one decoding step, with the key/value cache.

    Returns:
      logits: float32[batch, tgt_len, tgt_vocab].
    """
    y = self.decoder(tgt_in, encoded, src_mask, tgt_mask, deterministic,
                     incremental)
    if self.config.tie_output_embedding:
      logits = self.target_embedding.attend(y)
    else:
      logits = self.output_projection(y)
    # The loss and the search's log_softmax run in float32 whatever the dtype.
    return logits.astype(jnp.float32)

  def __call__(self, src, tgt_in, src_mask, tgt_mask,
               deterministic: bool = True):
    """Teacher-forced forward pass.

    src: int32[batch, src_len]; tgt_in: int32[batch, tgt_len];
    src_mask: bool[batch, 1, 1, src_len]; tgt_mask: bool[batch, 1, tgt_len,
    tgt_len]. Returns logits: float32[batch, tgt_len, tgt_vocab].
    """
    encoded = self.encode(src, src_mask, deterministic)
    return self.decode(encoded, src_mask, tgt_in, tgt_mask, deterministic)
