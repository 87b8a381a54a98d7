"""Host memory on a CPU backend: reuse each step's buffers instead of faulting them in.

Every call of a compiled step on XLA's CPU backend allocates its temporary
buffers (673 MB for the `small` training step, batch 64 x 32) and frees them
when it returns. glibc's malloc serves blocks that large with a fresh mmap
(from a per-thread arena, on XLA's worker threads) and unmaps them on free,
so the next step's first touch of every page is a page fault: 177,000 per
`small` step, a sixth of its time on a 2-core machine. One arena, no mmap and
no trimming keep the freed blocks in the process, so the next step reuses
them (benchmarks/levers.py: keep_freed_memory: 1.2x on that step).

It has two prices. The process keeps its peak footprint instead of returning
it to the system. And one arena serialises every thread's malloc: compiling
is about a fifth slower (the copy preset's training step: 2.1 s instead of
1.75 s), and a run of small steps pays for it without any buffer large
enough to gain (the copy task: 29 s instead of 22 s). So train.py keeps
freed memory for translation, not for the copy task. On a GPU or TPU host the
step's buffers live on the device, so there it only costs: the function does
nothing where JAX will pick an accelerator.
"""

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import platform

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# Never trim: a threshold beyond any heap (mallopt takes an int).
_NEVER = 2**31 - 1


def will_run_on_cpu() -> bool:
  """Whether JAX will pick its CPU backend, told without starting JAX.

  JAX_PLATFORMS decides where it is set; otherwise JAX prefers an installed
  accelerator: a PJRT plugin (the `jax_plugins` entry points, e.g. the CUDA
  plugin) or libtpu.
  """
  platforms = os.environ.get('JAX_PLATFORMS', '').strip()
  if platforms:
    return platforms.split(',')[0].strip() == 'cpu'
  return (not importlib.metadata.entry_points(group='jax_plugins') and
          importlib.util.find_spec('libtpu') is None)


def keep_freed_memory() -> bool:
  """Makes glibc's malloc keep freed memory for reuse; False where it does not.

  Call it before JAX runs anything: XLA's worker threads pick their malloc
  arena at their first allocation, and once JAX has started they keep the
  arenas they have (measured: no fewer faults). It does nothing (and returns
  False) off glibc, e.g. on macOS, and where JAX will run on an accelerator.
  Process-wide, so it is for programs (train.py's translation runs, the
  benchmarks), not done on import of the library.
  """
  if (platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc' or
      not will_run_on_cpu()):
    return False
  libc = ctypes.CDLL(ctypes.util.find_library('c'))
  # mallopt returns 1 on success, 0 on error.
  return all(libc.mallopt(parameter, value) == 1 for parameter, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER)))
