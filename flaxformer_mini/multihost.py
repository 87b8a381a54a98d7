"""Multi-host runs: joining JAX's multi-controller runtime, taking turns,
and one line on every process when one of them stops.

`initialize` joins (one process per host; `parallel.py` then spans every
device of every process). `process_0_first` runs a step such as the data's
preparation on process 0 before the others, and tells the others in one
line when process 0 failed at it, instead of leaving them at a barrier until
it times out. `lost_peer` recognises the error a collective raises when
another process has died, and `stopped_process` names that process.

JAX's coordination service ends a process whose peer it has lost with a
fatal C++ error (an abort and a stack trace, from one of its threads: Python
never sees it). `supervise` runs the command as a child process and turns
that end into the one line a user needs.
"""

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, TypeVar

import jax

# How long a process may go silent before the others are told it stopped
# (JAX's default is 100 s): a killed peer ends the run within this.
HEARTBEAT_SECONDS = 20
# How long a process waits for another to finish its turn (a first data
# preparation of a large corpus takes many minutes).
TURN_SECONDS = 24 * 3600
# Words of the errors JAX raises in a process whose peer has gone: Gloo's
# (CPU), NCCL's and the coordination service's.
_PEER_GONE = re.compile(
    r'Gloo|NCCL|Connection reset|Connection closed|Socket closed|heartbeat|'
    r'UNAVAILABLE|DEADLINE_EXCEEDED|another task', re.IGNORECASE)

T = TypeVar('T')


class MultihostError(RuntimeError):
  """This process cannot join, or go on with, a multi-host run; the message
  says why and what to do."""


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None, timeout_s: int = 300) -> None:
  """Joins JAX's multi-controller runtime (one process per host).

  On Cloud TPU pods and SLURM/Kubernetes GPU clusters JAX finds the other
  processes itself; elsewhere pass the coordinator's host:port, the number of
  processes and this process's index. Waits at most `timeout_s` for all of
  them: a process other than the coordinator first waits for the
  coordinator's port to open (a clear error if it never does); the
  coordinator waits for the others inside JAX, which ends the process with
  DEADLINE_EXCEEDED if they do not come.

  Once joined, a process that stops (killed, a machine lost) is seen by the
  others at their next collective (`lost_peer`), or within HEARTBEAT_SECONDS
  by JAX's coordination service, which then aborts them (`supervise` turns
  that into one line).

  Raises:
    MultihostError: no cluster was found, or no coordinator answered.
  """
  if coordinator_address:
    print(f'joining {num_processes} processes at {coordinator_address} as '
          f'process {process_id}; waiting up to {timeout_s} s for all of '
          'them to start', flush=True)
    if process_id:
      _wait_for_port(coordinator_address, timeout_s)
  try:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes,
                               process_id=process_id,
                               initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=HEARTBEAT_SECONDS)
  except (ValueError, RuntimeError) as e:
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise MultihostError(
        f'could not join a multi-host run ({first_line[:200]}). On a '
        'cluster JAX detects (Cloud TPU, SLURM, Kubernetes) start one process '
        'per host; elsewhere give --coordinator_address, --num_processes and '
        '--process_id, and start every process.') from None


def _wait_for_port(address: str, timeout_s: int) -> None:
  """Returns once host:port accepts a connection; MultihostError after timeout_s."""
  host, _, port = address.rpartition(':')
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=5):
        return
    except OSError:
      if time.monotonic() > deadline:
        raise MultihostError(
            f'no coordinator answered at {address} within {timeout_s} s: '
            'start process 0 there first (or check --coordinator_address).'
        ) from None
      time.sleep(1)


def lost_peer(error: BaseException) -> bool:
  """Whether `error`, in a multi-host run, says another process has gone."""
  return (jax.process_count() > 1 and
          isinstance(error, (jax.errors.JaxRuntimeError, RuntimeError)) and
          bool(_PEER_GONE.search(str(error))))


def stopped_process(detail: str, me: int | None, count: int | None) -> str:
  """Which process stopped, from what the runtime reported to process `me`
  of `count` (None: not known): -> 'process N' or 'another process'."""
  if task := re.search(r'[Tt]ask (\d+)', detail):
    return f'process {task.group(1)}'
  if 'Socket closed' in detail:  # the coordination service is process 0's
    return 'process 0'
  if count == 2 and me is not None:
    return f'process {1 - me}'
  return 'another process'


def never_joined(detail: str) -> bool:
  """Whether the runtime ended a process before every process had joined
  (as it reports the coordination service's registration timing out)."""
  return 'RegisterTask' in detail


def _client():
  """This process's client of the coordination service (its key-value
  store). Private in JAX; orbax's multi-host barriers use it the same way."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


def process_0_first(step: Callable[[], T], what: str) -> T:
  """step() on process 0, then on the other processes; returns its result.

  A step whose result lands on a shared disk (the data's preparation) is
  then done once, by process 0, and read by the others. Each process posts
  how its turn ended in the coordination service's key-value store, so a
  failure ends every process with one line naming the process and its
  error, not a barrier's timeout.

  Raises:
    MultihostError: another process failed at `what` (this one's own
      failure is raised as it is).
  """
  if jax.process_count() == 1:
    return step()
  client, me = _client(), jax.process_index()
  if me != 0:
    _wait_for_turn(client, 0, what)
  try:
    result = step()
  except BaseException as e:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    client.key_value_set(f'flaxformer_mini/{what}/{me}', f'failed: {first}')
    raise
  client.key_value_set(f'flaxformer_mini/{what}/{me}', 'done')
  for other in range(1, jax.process_count()):
    if other != me:
      _wait_for_turn(client, other, what)
  return result


def _wait_for_turn(client, process: int, what: str) -> None:
  outcome = client.blocking_key_value_get(f'flaxformer_mini/{what}/{process}',
                                          TURN_SECONDS * 1000)
  if outcome != 'done':
    raise MultihostError(
        f'process {process} stopped while {what} '
        f'({outcome.removeprefix("failed: ")}); see its log, mend that, and '
        'start every process again with the same command.')


# The command's child process runs with this set (`supervise`).
SUPERVISED = 'FLAXFORMER_MINI_SUPERVISED'
# Lines of JAX's C++ runtime (absl's log prefix, a fatal error's stack
# trace and the lines of its messages): held back a moment, long enough to
# see whether the runtime is aborting the process for a lost peer.
_RUNTIME_LINE = re.compile(
    rb'[EFWI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|\*\*\* Check failure| +@ '
    rb'+0x|terminate called|  what\(\)|Additional GRPC error|:UNKNOWN:|RPC: '
    rb'/|Barrier result|This suggests that the workers|The following tasks|'
    rb'\d+\n|The tasks have crashed|This indicates that')
_HOLD_SECONDS = 2.0
# What the runtime says when a peer is gone.
_PEER_LOST = re.compile(rb'distributed service detected fatal errors|another '
                        rb'task died|heartbeat timeout|Polled an error|'
                        rb'Socket closed')


def supervise(argv: list[str], lost: Callable[[str], str]) -> int:
  """Runs `python argv` as a child process; returns its exit code.

  The child's stdout is this process's; its stderr is passed through as it
  comes, but for the lines of JAX's C++ runtime, held back a moment. Where
  the runtime aborts the child because a peer was lost, they are replaced by
  the one line `lost(what the runtime said)` and the code is 1; where the
  child ended itself after saying so (a failed collective), they are
  dropped; otherwise they are passed on. SIGTERM and SIGHUP (a scheduler's)
  are passed to the child; Ctrl-C reaches it from the terminal directly.
  """
  child = subprocess.Popen([sys.executable, *argv], stderr=subprocess.PIPE,
                           env={**os.environ, SUPERVISED: '1'},
                           preexec_fn=_end_with_parent)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  for signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, lambda signum, _: child.send_signal(signum))
  stream = _RuntimeLines(child.stderr.fileno(), sys.stderr.fileno())
  while stream.pass_on(alive=child.poll() is None):
    pass
  code = child.wait()
  said = b''.join(stream.held) + stream.line
  if _PEER_LOST.search(said) and code != 0:
    if code < 0:  # aborted by the runtime
      os.write(sys.stderr.fileno(),
               (lost(said.decode(errors='replace')) + '\n').encode())
    return 1
  os.write(sys.stderr.fileno(), said)
  return code if code >= 0 else 128 - code


def _end_with_parent() -> None:
  """In the child, before it runs: killed with its supervisor (Linux's
  PR_SET_PDEATHSIG), so that a supervisor killed (kill -9, a lost machine)
  leaves no orphan training on."""
  if sys.platform.startswith('linux'):
    import ctypes  # pylint: disable=g-import-not-at-top
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # SET_PDEATHSIG


class _RuntimeLines:
  """A child's stderr passed on, but for the runtime's lines (`held`)."""

  def __init__(self, source: int, target: int):
    self.source, self.target = source, target
    self.held, self.held_since = [], 0.0
    self.line, self.line_since = b'', 0.0  # the current line, not passed on
    self.passing = False  # part of the current line is passed on already

  def pass_on(self, alive: bool) -> bool:
    """Passes on what the child wrote within a moment; False at its end."""
    if select.select([self.source], [], [], 0.25)[0]:
      chunk = os.read(self.source, 65536)
      if not chunk:
        return False
      for piece in re.findall(rb'[^\n]*\n|[^\n]+', chunk):
        self._take(piece)
    now = time.monotonic()
    if (self.line and now - self.line_since > 0.25 and
        not _RUNTIME_LINE.match(self.line)):  # e.g. a progress bar's update
      os.write(self.target, self.line)
      self.line, self.passing = b'', True
    if self.held and alive and now - self.held_since > _HOLD_SECONDS:
      os.write(self.target, b''.join(self.held))
      self.held = []
    return True

  def _take(self, piece: bytes) -> None:
    ended = piece.endswith(b'\n')
    if self.passing:
      os.write(self.target, piece)
      self.passing = not ended
      return
    if not self.line:
      self.line_since = time.monotonic()
    self.line += piece
    if not ended:
      return
    if _RUNTIME_LINE.match(self.line):
      if not self.held:
        self.held_since = time.monotonic()
      self.held.append(self.line)
    else:
      os.write(self.target, self.line)
    self.line = b''
