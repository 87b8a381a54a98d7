"""A run's folder: one run at a time, and nothing lost when starting over.

    WORKDIR/
      .lock               held by the run that uses the folder (its pid inside)
      checkpoints/        orbax steps: resumed from by the next run
      metrics.jsonl       every logged record; tensorboard/ the same as events
      results.json        the run's outcome; curves.png its training curves
      spm.model, tfds/    translation: the vocabulary and the prepared data,
                          with prepared.json saying what they were made from
      set-aside-<time>/   what --fresh moved out of the way

A second run on the same folder is refused at once, naming the process that
holds it; the lock is the kernel's (flock), so a run killed with SIGKILL
leaves no lock behind. In a multi-host run the first process holds it.
"""

import fcntl
import json
import os
import socket
import time
from typing import Iterable

import jax

LOCK = '.lock'
SET_ASIDE_PREFIX = 'set-aside-'


class WorkdirError(Exception):
  """The workdir cannot be used as it is; the message says what to do."""


class Workdir:
  """A run's workdir, held (`with Workdir(path) as workdir:`) while it runs."""

  def __init__(self, path: str):
    self.path = os.path.abspath(path)
    self._lock_fd = None

  def path_of(self, *names: str) -> str:
    return os.path.join(self.path, *names)

  def __enter__(self) -> 'Workdir':
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise WorkdirError(f'--workdir={self.path} is a file, not a folder; '
                         'name a folder (it is created if missing).')
    try:
      os.makedirs(self.path, exist_ok=True)
    except OSError as e:
      raise WorkdirError(f'--workdir={self.path} cannot be created '
                         f'({e.strerror}); name a folder you can write to.'
                         ) from None
    if not os.access(self.path, os.W_OK):
      raise WorkdirError(
          f'--workdir={self.path} is not writable, and training writes its '
          'checkpoints and logs there: copy the run to a writable folder to '
          'go on (the translate command and the tour read it where it is).')
    if jax.process_index() == 0:
      self._lock()
    return self

  def _lock(self) -> None:
    fd = os.open(self.path_of(LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.read(fd, 200).decode(errors='replace').strip() or 'unknown'
      os.close(fd)
      raise WorkdirError(
          f'{self.path} is in use by another run ({holder}): wait for it to '
          'finish, stop it, or use another --workdir.') from None
    os.ftruncate(fd, 0)
    os.write(fd, f'pid {os.getpid()} on {socket.gethostname()}, since '
             f'{time.strftime("%Y-%m-%d %H:%M:%S")}'.encode())
    self._lock_fd = fd

  def __exit__(self, *exc) -> None:
    if self._lock_fd is not None:
      fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
      os.close(self._lock_fd)
      self._lock_fd = None

  def set_aside(self, keep: Iterable[str] = ()) -> str | None:
    """Moves everything earlier runs wrote, but `keep`, into set-aside-<time>/.

    Returns that folder, or None when there was nothing to move. Earlier
    set-aside folders stay where they are.
    """
    keep = set(keep) | {LOCK}
    entries = sorted(e for e in os.listdir(self.path) if e not in keep and
                     not e.startswith(SET_ASIDE_PREFIX))
    if not entries:
      return None
    stamp = time.strftime('%Y%m%d-%H%M%S')
    target, n = self.path_of(SET_ASIDE_PREFIX + stamp), 1
    while os.path.exists(target):
      n += 1
      target = self.path_of(f'{SET_ASIDE_PREFIX}{stamp}-{n}')
    os.makedirs(target)
    for entry in entries:
      os.rename(self.path_of(entry), os.path.join(target, entry))
    return target

  def read_json(self, name: str) -> dict | None:
    """WORKDIR/name parsed, or None if it does not exist."""
    if not os.path.isfile(self.path_of(name)):
      return None
    with open(self.path_of(name)) as f:
      return json.load(f)

  def write_json(self, name: str, content: dict) -> str:
    """Writes WORKDIR/name (whole, or not at all); returns its path."""
    path = self.path_of(name)
    with open(path + '.tmp', 'w') as f:
      json.dump(content, f, indent=2)
    os.replace(path + '.tmp', path)
    return path
