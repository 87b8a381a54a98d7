"""Batches made ahead of the training step that takes them (grain).

The next batches are read and padded in threads while the device runs the
current step. Steps are the dataset's indices, so the order is the steps'
whatever the threads do, and a resumed run (a later start) reads the same
batches.
"""

import logging
from typing import Callable, Iterator

from flaxformer_mini.masks import Batch

# Batches made ahead, by this many threads. One thread makes millions of
# target tokens a second, and more contend for the interpreter
# (docs/performance.md, "Input").
PREFETCH_BATCHES = 4
INPUT_THREADS = 1


class _QuietGrain(logging.Filter):
  """grain's import-time warning about its profiler and older jaxlibs."""

  def filter(self, record):
    return 'multiprocess worker profiling' not in record.getMessage()


_QUIET_GRAIN = _QuietGrain()


def prefetched(batch_at: Callable[[int], Batch], start: int, stop: int,
               threads: int = INPUT_THREADS) -> Iterator[Batch]:
  """batch_at(start), ..., batch_at(stop - 1), made ahead in `threads` threads.

  Close the iterator when done with it (`.close()`).
  """
  # Imported here, after a filter: with jaxlib before 0.11 (Colab's 0.7.2)
  # grain warns at import about a profiler this project does not use.
  logging.getLogger('absl').addFilter(_QUIET_GRAIN)
  import grain  # pylint: disable=g-import-not-at-top
  dataset = grain.MapDataset.range(start, stop).map(batch_at)
  return iter(dataset.to_iter_dataset(grain.ReadOptions(
      num_threads=threads, prefetch_buffer_size=PREFETCH_BATCHES)))
