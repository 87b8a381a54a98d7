"""Batches by token budget with length buckets (Section 5.1).

The paper batches "by approximate sequence length", about 25,000 source and
25,000 target tokens per batch. Here every pair goes to the smallest bucket
length L that holds it (source + eos, and bos/eos + target); a batch of that
bucket has as many rows as fit in the budget, `rows * L <= tokens_per_batch`
on each side. The budget is the global batch's, over every device and host.
The bucket lengths grow geometrically, so padding stays small and XLA
compiles one program per bucket, not one per batch.

The batches of an epoch are a pure function of (seed, epoch): step s is batch
s % per_epoch of epoch s // per_epoch. The iterator's position is therefore
just the step, which is what a checkpoint saves, and a resumed run sees
exactly the batches the uninterrupted one would have seen. Planning an epoch
needs only the pairs' lengths; a batch reads only its own rows (for a
multi-host run, only this process's share of them).
"""

import functools
from typing import Protocol

import numpy as np

from flaxformer_mini.config import ConfigError, TransformerConfig
from flaxformer_mini.masks import Batch, make_batch


class PairSource(Protocol):
  """Tokenized sentence pairs: a `data.tokenized.TokenizedSplit`, or `Pairs`."""

  def __len__(self) -> int: ...

  def lengths(self) -> np.ndarray: ...

  def pair(self, index: int) -> tuple[np.ndarray, np.ndarray]: ...


class Pairs:
  """Pairs held in memory: lists of source and of target id arrays."""

  def __init__(self, src: list, tgt: list):
    self.src, self.tgt = src, tgt

  def __len__(self) -> int:
    return len(self.src)

  def lengths(self) -> np.ndarray:
    """int32[pairs, 2]: each pair's (source, target) token count."""
    return np.array([(len(s), len(t)) for s, t in zip(self.src, self.tgt)],
                    np.int32).reshape(-1, 2)

  def pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    return self.src[index], self.tgt[index]


def bucket_lengths(max_len: int, smallest: int = 8,
                   growth: float = 1.3) -> tuple[int, ...]:
  """Geometric bucket lengths (multiples of 4, for tidy shapes) up to max_len."""
  lengths, length = [], smallest
  while length < max_len:
    lengths.append(length)
    length = max(length + 4, int(length * growth) // 4 * 4)
  return tuple(lengths) + (max_len,)


def check_budget(tokens_per_batch: int, max_len: int, rows: int) -> None:
  """A clear error, before any data is read, for a token budget that holds
  no batch of `rows` rows (one per device and micro-batch) of max_len.

  Raises:
    ConfigError: naming tokens_per_batch.
  """
  if tokens_per_batch < max_len * rows:
    raise ConfigError(
        f'tokens_per_batch={tokens_per_batch}: holds no batch of {rows} '
        f'row(s) (one per device and micro-batch) of length max_len='
        f'{max_len}; raise it to at least {max_len * rows}, or lower max_len '
        'or grad_accumulation.')


class TokenBatches:
  """Bucketed batches of one dataset under a token budget.

  `batch_at(step)` gives the Batch of training step `step`: src int32[rows, L],
  tgt_in / tgt_out int32[rows, L]. Rows are a multiple of `row_multiple` (the
  device count, times the micro-batches of gradient accumulation), topped up
  with rows of pad that add nothing to the loss. Empty pairs and pairs longer
  than max_len (source + eos or bos + target + eos past max_len + 1) are left
  out: `used`, `empty` and `too_long` count them.
  """

  def __init__(self, pairs: PairSource, config: TransformerConfig,
               tokens_per_batch: int, row_multiple: int = 1,
               shuffle: bool = True):
    self.config, self.pairs = config, pairs
    self.buckets = bucket_lengths(config.max_len)
    self.shuffle = shuffle
    lengths = pairs.lengths()
    empty = (lengths == 0).any(axis=1)
    longest = lengths.max(axis=1, initial=0) + 1
    too_long = ~empty & (longest > config.max_len)
    self.empty, self.too_long = int(empty.sum()), int(too_long.sum())
    usable = np.flatnonzero(~empty & ~too_long).astype(np.int32)
    self.used = len(usable)
    bucket_of = np.searchsorted(self.buckets, longest[usable])
    # The pairs of each bucket, in corpus order.
    self.members = {int(b): usable[bucket_of == b]
                    for b in np.unique(bucket_of)}
    check_budget(tokens_per_batch, config.max_len, row_multiple)
    # Every bucket's batch: as many rows of its length as the budget holds.
    self.rows = {index: tokens_per_batch // length // row_multiple *
                 row_multiple for index, length in enumerate(self.buckets)}
    # The plans of the last two epochs asked for (the threads that make
    # batches ahead read across an epoch boundary). A cache of this instance:
    # one on the method would be shared by every instance and keep them alive.
    self._plan = functools.lru_cache(maxsize=2)(self._make_plan)
    self.per_epoch = len(self._plan(0))

  def rows_of(self, length: int) -> int:
    """Rows of every batch whose sentences are padded to `length`."""
    return self.rows[self.buckets.index(length)]

  def shapes(self) -> set[tuple[int, int]]:
    """The distinct (rows, length) batch shapes that can occur."""
    return {(self.rows[b], self.buckets[b]) for b in self.members}

  def _make_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
    """[(bucket, example indices)] for every batch of `epoch`, in order."""
    rng = np.random.default_rng((self.config.seed, epoch))
    batches = []
    for bucket, members in sorted(self.members.items()):
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
    """Shard `index` of `count` of the Batch of examples `members`: src
    int32[rows / count, length], tgt_in and tgt_out int32[rows / count,
    length], rows past the members all pad. Only the shard's pairs are read.
    """
    cfg = self.config
    index, count = shard
    part = rows // count
    src = np.full((part, length), cfg.pad_id, np.int32)
    tgt = np.full((part, length + 1), cfg.pad_id, np.int32)
    for row, example in enumerate(members[index * part:(index + 1) * part]):
      s, t = self.pairs.pair(example)
      src[row, :len(s)] = s
      src[row, len(s)] = cfg.eos_id
      tgt[row, 0] = cfg.bos_id
      tgt[row, 1:len(t) + 1] = t
      tgt[row, len(t) + 1] = cfg.eos_id
    return make_batch(src, tgt, cfg)
