"""What every benchmark shares: timing, the machine's description, JSON out."""

import datetime
import json
import os
import platform
import statistics
import time

import jax
import numpy as np

# glibc malloc settings that keep a step's freed host buffers for the next
# step instead of returning them to the system (and faulting them in again):
# one arena, no mmap, no trimming. run_all.py starts every CPU benchmark with
# them (docs/performance.md, "Host memory"); they do nothing elsewhere.
KEEP_FREED_MEMORY = ('glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:'
                     'glibc.malloc.trim_threshold=2147483647')


def environment() -> dict:
  """The machine and versions a figure was measured on."""
  return {
      'backend': jax.default_backend(),
      'devices': jax.device_count(),
      'device_kind': jax.devices()[0].device_kind,
      'cpu_count': os.cpu_count(),
      'machine': platform.processor() or platform.machine(),
      'jax': jax.__version__,
      'glibc_tunables': os.environ.get('GLIBC_TUNABLES', ''),
      'date': datetime.date.today().isoformat(),
  }


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


def _wall_times(run, repeats: int) -> list[float]:
  return interleaved_seconds({'run': run}, repeats)['run']


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


# Bootstrap resamples behind a speed-up's interval.
_RESAMPLES = 2000


def speedup(theirs: list[float], ours: list[float]) -> dict:
  """Their time over ours, from the times of interleaved rounds.

  `speedup` is the ratio of the medians. `speedup_interval` is its 90 %
  bootstrap interval: the same ratio over rounds drawn again with
  replacement (a round's two times stay together), how far one comparison
  on this shared machine can be trusted. The rounds' times are kept too.
  """
  theirs, ours = np.asarray(theirs), np.asarray(ours)
  rounds = np.random.default_rng(0).integers(0, len(ours),
                                             (_RESAMPLES, len(ours)))
  ratios = np.median(theirs[rounds], axis=1) / np.median(ours[rounds], axis=1)
  return {'speedup': float(np.median(theirs) / np.median(ours)),
          'speedup_interval': [float(q) for q in
                               np.percentile(ratios, [5, 95])],
          'round_seconds': {'theirs': theirs.tolist(), 'ours': ours.tolist()}}


def measured_by(env: dict, command: str) -> str:
  """A docs table's first words: when, on what, and the command that made
  it (`python benchmarks/...`, without `python `)."""
  return (f"Measured {env['date']} on {env['cpu_count']} CPU cores "
          f"({env['machine']}), JAX {env['jax']}, by `python {command}`: ")


def emit(result: dict) -> None:
  """Prints the benchmark's one JSON object."""
  print(json.dumps({**result, 'environment': environment()}, indent=2))
