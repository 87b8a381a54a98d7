"""Masks, and the Batch: what exactly one training item is.

A mask is boolean, True where attention is allowed. Masks have a singleton
heads axis so that they broadcast over [batch, heads, q_len, k_len].
"""

import flax.struct
import jax.numpy as jnp
import numpy as np

from flaxformer_mini.config import TransformerConfig


def padding_mask(ids, pad_id: int):
  """Keys that are real tokens: ids: int32[batch, len] -> bool[batch, 1, 1, len]."""
  return (ids != pad_id)[:, None, None, :]


def causal_mask(length: int):
  """The subsequent mask: position i may attend to j <= i. -> bool[1, 1, len, len].

  A numpy constant: inside jit it is folded into the program, and a batch
  made on the host stays on the host.
  """
  return np.tril(np.ones((length, length), dtype=bool))[None, None]


def target_mask(tgt_in, pad_id: int):
  """Padding AND causal: tgt_in: int32[batch, len] -> bool[batch, 1, len, len]."""
  return padding_mask(tgt_in, pad_id) & causal_mask(tgt_in.shape[1])


@flax.struct.dataclass
class Batch:
  """One training batch; item b is one (source, target) sentence pair.

  The target is shifted by one between input and output: the decoder reads
  `tgt_in` = [bos, y1, ..., yn] and must predict `tgt_out` = [y1, ..., yn, eos],
  so position t is trained to predict token t+1 from tokens <= t. No data is
  lost: every target token appears in tgt_out, and each item contributes one
  classification per real target token.

  Attributes:
    src: int32[batch, src_len], the source ids, pad-filled.
    tgt_in: int32[batch, tgt_len], the target without its last token.
    tgt_out: int32[batch, tgt_len], the target without its first token.
    src_mask: bool[batch, 1, 1, src_len], True on real source tokens.
    tgt_mask: bool[batch, 1, tgt_len, tgt_len], padding AND causal.
    ntokens: int32[], the number of real (non-pad) tokens in tgt_out.
  """
  src: jnp.ndarray
  tgt_in: jnp.ndarray
  tgt_out: jnp.ndarray
  src_mask: jnp.ndarray
  tgt_mask: jnp.ndarray
  ntokens: jnp.ndarray


def make_batch(src, tgt, config: TransformerConfig) -> Batch:
  """Builds a Batch from pad-filled ids, on the host: numpy arrays, which
  every JAX function takes as they are (the input pipeline makes batches in
  threads and the step places them on the devices; nothing is computed on a
  device or compiled to make one).

  Args:
    src: int32[batch, src_len].
    tgt: int32[batch, tgt_len + 1], each row bos, the sentence, eos, then pad.
    config: supplies pad_id.
  """
  src = np.asarray(src, np.int32)
  tgt = np.asarray(tgt, np.int32)
  tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
  return Batch(
      src=src,
      tgt_in=tgt_in,
      tgt_out=tgt_out,
      src_mask=padding_mask(src, config.pad_id),
      tgt_mask=target_mask(tgt_in, config.pad_id),
      ntokens=np.int32(np.sum(tgt_out != config.pad_id)))
