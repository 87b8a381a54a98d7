"""Batches by token budget with length buckets (Section 5.1).

The paper batches "by approximate sequence length", about 25,000 source and
25,000 target tokens per batch. Here every pair goes to the smallest bucket
length L that holds it (source + eos, and bos/eos + target); a batch of that
bucket has as many rows as fit in the budget, `rows * L <= tokens_per_batch`
on each side. The bucket lengths grow geometrically, so padding stays small
and XLA compiles one program per bucket, not one per batch.

The batches of an epoch are a pure function of (seed, epoch): step s is batch
s % per_epoch of epoch s // per_epoch. The iterator's position is therefore
just the step, which is what a checkpoint saves, and a resumed run sees
exactly the batches the uninterrupted one would have seen.
"""

import dataclasses
import functools

import numpy as np

from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.masks import Batch, make_batch


def bucket_lengths(max_len: int, smallest: int = 8,
                   growth: float = 1.3) -> tuple[int, ...]:
  """Geometric bucket lengths (multiples of 4, for tidy shapes) up to max_len."""
  lengths, length = [], smallest
  while length < max_len:
    lengths.append(length)
    length = max(length + 4, int(length * growth) // 4 * 4)
  return tuple(lengths) + (max_len,)


@dataclasses.dataclass
class Filtered:
  """What was kept, and what was left out and why (for the log)."""
  src: list
  tgt: list
  empty: int = 0
  too_long: int = 0


def filter_pairs(src: list, tgt: list, max_len: int) -> Filtered:
  """Drops empty pairs and pairs longer than max_len (counting both).

  src, tgt: lists of int arrays (token ids without specials). A pair is too
  long when the source + eos or bos + target + eos exceeds max_len + 1.
  """
  kept = Filtered([], [])
  for s, t in zip(src, tgt):
    if len(s) == 0 or len(t) == 0:
      kept.empty += 1
    elif len(s) + 1 > max_len or len(t) + 1 > max_len:
      kept.too_long += 1
    else:
      kept.src.append(s)
      kept.tgt.append(t)
  return kept


class TokenBatches:
  """Bucketed batches of one dataset under a token budget.

  `batch_at(step)` gives the Batch of training step `step`: src int32[rows, L],
  tgt_in / tgt_out int32[rows, L]. Rows are a multiple of `row_multiple` (the
  device count), topped up with rows of pad that add nothing to the loss.
  """

  def __init__(self, src: list, tgt: list, config: TransformerConfig,
               tokens_per_batch: int, row_multiple: int = 1,
               shuffle: bool = True):
    self.config = config
    self.src, self.tgt = src, tgt
    self.buckets = bucket_lengths(config.max_len)
    self.shuffle = shuffle
    lengths = np.array([max(len(s), len(t)) + 1 for s, t in zip(src, tgt)])
    if lengths.size and lengths.max() > config.max_len:
      raise ValueError('filter_pairs first: a pair exceeds --max_len.')
    self.bucket_of = np.searchsorted(self.buckets, lengths)
    self.rows = {}
    for index, length in enumerate(self.buckets):
      rows = tokens_per_batch // length // row_multiple * row_multiple
      if rows == 0:
        raise ValueError(
            f'--tokens_per_batch={tokens_per_batch} holds no '
            f'{row_multiple}-row batch of length {length}; raise it to at '
            f'least {length * row_multiple}.')
      self.rows[index] = rows
    self.per_epoch = len(self._plan(0))

  def rows_of(self, length: int) -> int:
    """Rows of every batch whose sentences are padded to `length`."""
    return self.rows[self.buckets.index(length)]

  def shapes(self) -> set[tuple[int, int]]:
    """The distinct (rows, length) batch shapes that can occur."""
    return {(self.rows[b], self.buckets[b]) for b in set(self.bucket_of)}

  @functools.lru_cache(maxsize=2)
  def _plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
    """[(bucket, example indices)] for every batch of `epoch`, in order."""
    rng = np.random.default_rng((self.config.seed, epoch))
    batches = []
    for bucket in sorted(set(self.bucket_of)):
      members = np.flatnonzero(self.bucket_of == bucket)
      if self.shuffle:
        members = rng.permutation(members)
      rows = self.rows[bucket]
      batches += [(bucket, members[i:i + rows])
                  for i in range(0, len(members), rows)]
    if self.shuffle:
      batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches

  def epoch_batches(self, epoch: int = 0):
    """Every batch of one epoch, as (bucket length, example indices)."""
    return [(self.buckets[b], members) for b, members in self._plan(epoch)]

  def batch_at(self, step: int, shard: tuple[int, int] = (0, 1)) -> Batch:
    """Shard `index` of `count` of the rows of training step `step`."""
    epoch, position = divmod(step, self.per_epoch)
    bucket, members = self._plan(epoch)[position]
    return self.make(members, self.buckets[bucket], self.rows[bucket], shard)

  def make(self, members, length: int, rows: int,
           shard: tuple[int, int] = (0, 1)) -> Batch:
    """The Batch of examples `members`: src int32[rows, length], tgt_in and
    tgt_out int32[rows, length], rows past the members all pad (shard
    `index` of `count` of them)."""
    cfg = self.config
    src = np.full((rows, length), cfg.pad_id, np.int32)
    tgt = np.full((rows, length + 1), cfg.pad_id, np.int32)
    for row, example in enumerate(members):
      s, t = self.src[example], self.tgt[example]
      src[row, :len(s) + 1] = np.append(s, cfg.eos_id)
      tgt[row, :len(t) + 2] = np.concatenate([[cfg.bos_id], t, [cfg.eos_id]])
    index, count = shard
    part = rows // count
    rows_of_shard = slice(index * part, (index + 1) * part)
    return make_batch(src[rows_of_shard], tgt[rows_of_shard], cfg)
