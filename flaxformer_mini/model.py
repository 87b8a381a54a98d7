"""Figure 1 as a whole: the encoder stack, the decoder stack, the Transformer.

`Transformer.encode` and `Transformer.decode` are separate so that decoding
runs the encoder once and then calls the decoder token by token.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.embeddings import PositionalEncoding, TokenEmbedding
from flaxformer_mini.layers import DecoderLayer, EncoderLayer
from flaxformer_mini.linear import dense


class Encoder(nn.Module):
  """Embedding + positions, then N encoder layers (the left half of Figure 1)."""
  config: TransformerConfig
  embedding: TokenEmbedding

  @nn.compact
  def __call__(self, src, src_mask, deterministic: bool = True):
    """src: int32[batch, src_len]; src_mask: bool[batch, 1, 1, src_len].

    Returns the encoder output ("memory"): [batch, src_len, d_model].
    """
    cfg = self.config
    tokens = self.embedding(src)
    self.sow('intermediates', 'token_embedding', tokens)
    x = PositionalEncoding(cfg)(tokens)
    self.sow('intermediates', 'embedded', x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    layer = (nn.remat(EncoderLayer, static_argnums=(3,)) if cfg.remat else
             EncoderLayer)  # argument 3 (self is 0): deterministic
    if cfg.scan_layers:
      x, _ = _scanned_layers(cfg, layer, cfg.num_encoder_layers,
                             (deterministic,))(x, src_mask)
    else:
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
               deterministic: bool = True, decode: bool = False):
    """tgt_in: int32[batch, tgt_len] -> [batch, tgt_len, d_model].

    encoded: [batch, src_len, d_model]; src_mask: bool[batch, 1, 1, src_len];
    tgt_mask: bool[batch, 1, tgt_len, tgt_len] or None in decode mode.
    """
    cfg = self.config
    tokens = self.embedding(tgt_in)
    self.sow('intermediates', 'token_embedding', tokens)
    y = PositionalEncoding(cfg)(tokens, decode=decode)
    self.sow('intermediates', 'embedded', y)
    y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    if decode and cfg.scan_layers:
      raise ValueError(
          'Decoding runs the unrolled layers: decode with '
          'model.unrolled(params, config) (the decoding module does).')
    # Nothing to recompute while decoding: no backward pass.
    layer = (nn.remat(DecoderLayer, static_argnums=(5, 6))
             if cfg.remat and not decode else DecoderLayer)
    if cfg.scan_layers:
      y, _ = _scanned_layers(cfg, layer, cfg.num_decoder_layers,
                             (deterministic, decode))(y, encoded, src_mask,
                                                      tgt_mask)
    else:
      for i in range(cfg.num_decoder_layers):
        y = layer(cfg, name=f'layer_{i}')(
            y, encoded, src_mask, tgt_mask, deterministic, decode)
    if cfg.pre_norm:
      y = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype,
                       name='final_norm')(y)
    return y


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
      self.output_projection = dense(cfg.tgt_vocab_size, cfg)

  def encode(self, src, src_mask, deterministic: bool = True):
    """src: int32[batch, src_len] -> float32[batch, src_len, d_model]."""
    return self.encoder(src, src_mask, deterministic)

  def decode(self, encoded, src_mask, tgt_in, tgt_mask=None,
             deterministic: bool = True, decode: bool = False):
    """Decoder stack + the final linear layer.

    Args:
      encoded: [batch, src_len, d_model], from `encode`.
      src_mask: bool[batch, 1, 1, src_len].
      tgt_in: int32[batch, tgt_len] (tgt_len = 1 per step in decode mode).
      tgt_mask: bool[batch, 1, tgt_len, tgt_len]; None in decode mode.
      deterministic: disables dropout.
      decode: incremental decoding with the key/value cache.

    Returns:
      logits: float32[batch, tgt_len, tgt_vocab].
    """
    y = self.decoder(tgt_in, encoded, src_mask, tgt_mask, deterministic,
                     decode)
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


# Layers as one scan (config.scan_layers): an option for deep models, whose
# compile time grows with depth when every layer is unrolled.

_STACKS = {'encoder': 'num_encoder_layers', 'decoder': 'num_decoder_layers'}


class _ScanBody(nn.Module):
  """One layer as nn.scan's body: x and the shared arguments -> (x, None).

  `trailing` holds the layer's Python arguments (deterministic, decode),
  which nn.scan cannot carry or broadcast as arrays.
  """
  config: TransformerConfig
  layer: type
  trailing: tuple

  @nn.compact
  def __call__(self, x, *shared):
    return self.layer(self.config, name='layer')(x, *shared,
                                                 *self.trailing), None


def _scanned_layers(config: TransformerConfig, layer: type, count: int,
                    trailing: tuple):
  """`count` layers as one nn.scan (config.scan_layers).

  Unrolled, every layer is its own module with its own XLA code, so compile
  time grows with depth. The scan runs one compiled layer `count` times over
  parameters stacked along a leading [count] axis (under .../layers/layer)
  and gives each layer its own dropout key. -> a module of (x, *shared)
  returning (x, None).
  """
  return nn.scan(_ScanBody, variable_axes={'params': 0, 'intermediates': 0},
                 split_rngs={'params': True, 'dropout': True},
                 in_axes=nn.broadcast, length=count)(
                     config, layer, trailing, name='layers')


def unroll_layers(params, config: TransformerConfig):
  """Parameters of a scan_layers model as those of the unrolled model.

  encoder/layers/layer/... [num_layers, ...] -> encoder/layer_i/... (and the
  same for the decoder); everything else is unchanged.
  """
  params = dict(params)
  for stack, count in _STACKS.items():
    layers = dict(params[stack])
    stacked = layers.pop('layers')['layer']
    for i in range(getattr(config, count)):
      layers[f'layer_{i}'] = jax.tree.map(lambda leaf, i=i: leaf[i], stacked)
    params[stack] = layers
  return params


def scan_layers(params, config: TransformerConfig):
  """The inverse of unroll_layers: per-layer parameters stacked for scan."""
  params = dict(params)
  for stack, count in _STACKS.items():
    layers = dict(params[stack])
    per_layer = [layers.pop(f'layer_{i}')
                 for i in range(getattr(config, count))]
    layers['layers'] = {
        'layer': jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_layer)}
    params[stack] = layers
  return params


def unrolled(params, config: TransformerConfig) -> tuple[Any, TransformerConfig]:
  """(params, config) of the same model with its layers unrolled.

  Decoding (one small step at a time: nothing for a loop to save) and the
  tensor tour (which names each layer's tensors) run the unrolled model.
  params may be None, for the config alone.
  """
  if not config.scan_layers:
    return params, config
  return (None if params is None else unroll_layers(params, config),
          config.replace(scan_layers=False))
