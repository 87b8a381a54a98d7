"""What every benchmark shares: timing, the machine's description, JSON out."""

import datetime
import json
import os
import platform
import statistics
import time

import jax
import numpy as np

from flaxformer_mini import host_memory

# Every benchmark runs its steps as `train.py --task=translate` does: with
# freed host memory kept for reuse (set here, on import, before any benchmark
# runs JAX). The copy-task benchmark runs train.py itself.
host_memory.keep_freed_memory()


def environment() -> dict:
  """The machine and versions a figure was measured on."""
  return {
      'backend': jax.default_backend(),
      'devices': jax.device_count(),
      'device_kind': jax.devices()[0].device_kind,
      'cpu_count': os.cpu_count(),
      'machine': platform.processor() or platform.machine(),
      'jax': jax.__version__,
      'date': datetime.date.today().isoformat(),
  }


def _wall_times(run, repeats: int) -> list[float]:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return times


def median_seconds(run, repeats: int) -> float:
  """Median wall time of `run()`, which must block until its work is done."""
  return statistics.median(_wall_times(run, repeats))


def best_seconds(run, repeats: int) -> float:
  """Fastest wall time of `run()`, which must block, after one warm-up call.

  For deterministic work on a shared machine, the fastest run is the one
  least disturbed by the rest of the machine.
  """
  run()
  return min(_wall_times(run, repeats))


def interleaved_seconds(runs: dict, repeats: int) -> dict[str, list[float]]:
  """Wall times of each blocking `runs[name]()`, taken in turns.

  Round i times every run once, so that a slow spell of the shared machine
  falls on all of them alike instead of on whichever ran then.
  """
  times = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  return times


def speedup(theirs: list[float], ours: list[float]) -> dict:
  """Their time over ours, from the times of interleaved rounds.

  `speedup` is the ratio of the medians; `speedup_quartiles` are the 25th
  and 75th percentiles of the round-by-round ratios, how far a single
  comparison on this machine can be trusted.
  """
  rounds = np.asarray(theirs) / np.asarray(ours)
  return {'speedup': statistics.median(theirs) / statistics.median(ours),
          'speedup_quartiles': [float(q) for q in
                                np.percentile(rounds, [25, 75])]}


def emit(result: dict) -> None:
  """Prints the benchmark's one JSON object."""
  print(json.dumps({**result, 'environment': environment()}, indent=2))
