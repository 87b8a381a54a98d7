"""What every benchmark shares: timing, the machine's description, JSON out."""

import datetime
import json
import os
import platform
import statistics
import time

import jax

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


def emit(result: dict) -> None:
  """Prints the benchmark's one JSON object."""
  print(json.dumps({**result, 'environment': environment()}, indent=2))
