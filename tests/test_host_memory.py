"""host_memory.keep_freed_memory: a step's freed buffers are reused, not faulted in again."""

import os
import platform
import subprocess
import sys

import pytest

from flaxformer_mini import host_memory

# A step-like computation: a [2048, 2048] activation from a matmul, then a
# nonlinearity and a reduction. Its buffers are allocated at every call and
# freed on return. Prints the page faults of three calls after two warm-ups.
FAULTS_OF_THREE_CALLS = """
import resource, sys
from flaxformer_mini import host_memory
if sys.argv[1] == 'keep':
  assert host_memory.keep_freed_memory()
import jax, jax.numpy as jnp
step = jax.jit(lambda x: jnp.sum(jnp.tanh(x @ x.T), axis=0))
x = jnp.ones((2048, 4096), jnp.float32)
for _ in range(2):
  step(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
  step(x).block_until_ready()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
  done = subprocess.run([sys.executable, '-c', FAULTS_OF_THREE_CALLS, mode],
                        capture_output=True, text=True, check=True,
                        env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  return int(done.stdout.split()[-1])


@pytest.mark.skipif(
    platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc',
    reason='keep_freed_memory configures glibc malloc (Linux only)')
def test_freed_buffers_are_reused_instead_of_faulted_in():
  activation_pages = 2048 * 2048 * 4 // 4096
  default = _faults('default')
  assert default > 3 * activation_pages  # each call faults its buffers in
  assert _faults('keep') < default / 10


def test_an_accelerator_backend_is_left_alone(monkeypatch):
  monkeypatch.setenv('JAX_PLATFORMS', 'cuda,cpu')
  assert not host_memory.will_run_on_cpu()
  assert not host_memory.keep_freed_memory()
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  assert host_memory.will_run_on_cpu()
