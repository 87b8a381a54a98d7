"""The copy task: the one-minute proof that the whole model is wired right.

Each item is a random sequence of `copy_length` ordinary tokens (ids above the
special ids); the target is the same sequence. Batches are a pure function of
(seed, step), so a run can be repeated or resumed without saving any iterator
state, and evaluation draws from a stream the training never sees.
"""

import numpy as np

from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.masks import Batch, make_batch

_TRAIN_STREAM, _EVAL_STREAM = 0, 1


def random_sequences(config: TransformerConfig, batch_size: int,
                     seed_words: tuple[int, ...]) -> np.ndarray:
  """Random ordinary tokens: -> int32[batch_size, copy_length].

  The config must have ordinary ids (tasks.train_copy.check_config checks it).
  """
  low = config.first_ordinary_id
  high = min(config.src_vocab_size, config.tgt_vocab_size)
  rng = np.random.default_rng(seed_words)
  return rng.integers(low, high, size=(batch_size, config.copy_length),
                      dtype=np.int32)


def with_bos_eos(sequences: np.ndarray, config: TransformerConfig) -> np.ndarray:
  """sequences: int32[batch, len] -> int32[batch, len + 2]: bos, the sequence, eos."""
  batch_size = sequences.shape[0]
  return np.concatenate([
      np.full((batch_size, 1), config.bos_id, np.int32), sequences,
      np.full((batch_size, 1), config.eos_id, np.int32)
  ], axis=1)


def train_batch(config: TransformerConfig, step: int,
                shard: tuple[int, int] = (0, 1)) -> Batch:
  """Shard `index` of `count` of the global training batch of `step`.

  Returns a Batch of src int32[batch / count, L] and tgt_in / tgt_out
  int32[batch / count, L + 1]:
  the consecutive block of rows that process `index` of `count` feeds (the
  whole global batch by default).
  """
  index, count = shard
  sequences = random_sequences(config, config.batch_size,
                               (config.seed, _TRAIN_STREAM, step))
  rows = config.batch_size // count
  sequences = sequences[index * rows:(index + 1) * rows]
  return make_batch(sequences, with_bos_eos(sequences, config), config)


def eval_sequences(config: TransformerConfig, count: int,
                   draw: int) -> np.ndarray:
  """Fresh sequences for evaluation draw `draw`: -> int32[count, copy_length]."""
  return random_sequences(config, count, (config.seed, _EVAL_STREAM, draw))


def exact_match(decoded: np.ndarray, sources: np.ndarray,
                config: TransformerConfig) -> float:
  """Fraction of rows whose decode is the source followed by eos.

  decoded: int32[batch, >= L + 1]; sources: int32[batch, L].
  """
  length = sources.shape[1]
  same = np.all(decoded[:, :length] == sources, axis=1)
  return float(np.mean(same & (decoded[:, length] == config.eos_id)))
