"""Writing to disk, for every writer of a run: whole files, and one line
when the disk is full.

`written_whole` writes a file beside its place and renames it there, so a
reader, a writer that dies, or a full disk never leaves half a file behind;
`new_folder` does the same for a folder the export commands write.

A full disk (or a quota, or a file-size limit) shows up in many forms: an
OSError from Python, a RESOURCE_EXHAUSTED ValueError from orbax's
TensorStore, a RuntimeError from TFDS, a SentencePiece model cut short.
`is_full` recognises them; `DiskFull` is what the run raises instead, naming
the folder and what to do, and train.py prints it as one line.
"""

import contextlib
import errno
import os
import shutil
import tempfile

# The end of a file's name while it is written (`written_whole`).
PARTIAL = '.partial'

# What the operating system says when no more can be written.
_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
WORDS = ('No space left on device', 'Disk quota exceeded', 'File too large')


class DiskFull(RuntimeError):
  """No room where the run writes; the message says where and what to do."""


def is_full(error: BaseException) -> bool:
  """Whether `error`, or one it was raised from, says the disk is full."""
  while error is not None:
    if isinstance(error, DiskFull):
      return True
    if isinstance(error, OSError) and error.errno in _ERRNOS:
      return True
    if any(words in str(error) for words in WORDS):
      return True
    error = error.__cause__ or error.__context__
  return False


def free_bytes(path: str) -> int:
  """Bytes that may still be written on the disk of `path` (a folder)."""
  return shutil.disk_usage(path).free


@contextlib.contextmanager
def written_whole(path: str, mode: str = 'w'):
  """Yields a file, opened with `mode`, that becomes `path` only once the
  block ends without an error: it is written as PATH.<pid>.partial and then
  renamed, so `path` holds the old file or the whole new one, never part of
  it, and processes writing the same path at once do not mix. On an error
  the partial file is removed and the error goes on.
  """
  partial = f'{path}.{os.getpid()}{PARTIAL}'
  try:
    with open(partial, mode) as f:
      yield f
    os.replace(partial, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(partial)
    raise


class FolderExists(FileExistsError):
  """A new folder was asked for where something is (nothing was changed)."""


def check_new_folder(path: str) -> None:
  """Raises FolderExists where `path` exists, NotADirectoryError where a
  file is where a folder above it would be, PermissionError where the
  nearest folder above it that exists cannot be written: the cheap checks,
  before work whose result would have nowhere to go (FileNotFoundError:
  `path` is empty)."""
  if not path:
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
  if os.path.lexists(path):
    raise _exists(path)
  above = os.path.dirname(os.path.abspath(path))
  while not os.path.lexists(above):
    above = os.path.dirname(above)
  if not os.path.isdir(above):
    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), above)
  if not os.access(above, os.W_OK | os.X_OK):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), above)


def _exists(path: str) -> FolderExists:
  return FolderExists(f'{path} exists; name a new folder (nothing there was '
                      'changed).')


@contextlib.contextmanager
def new_folder(path: str):
  """Yields an empty folder to fill, which becomes the new folder `path`
  once the block ends without an error, all or nothing: it is filled beside
  `path` and renamed into place, so no reader sees it half written, and an
  error leaves nothing of it behind (folders above `path` that were missing
  are made first, and stay).

  Raises:
    FolderExists: `path` exists, before the block or once it ends (made
      meanwhile: it is refused, never replaced).
    OSError: `path` cannot be made (`check_new_folder`).
  """
  check_new_folder(path)
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f'.{os.path.basename(path)}-', dir=parent)
  try:
    # Filled in a folder of its own inside the staging one: mkdtemp's is
    # readable by its owner only, and a server that runs as another user
    # must read what is written.
    filling = os.path.join(staging, 'folder')
    os.mkdir(filling)
    yield filling
    # os.rename replaces an empty folder: `path` is claimed first, so that
    # one made there since the check is refused, not replaced.
    try:
      os.mkdir(path)
    except FileExistsError as e:
      raise _exists(path) from e
    try:
      os.rename(filling, path)
    except OSError:
      with contextlib.suppress(OSError):
        os.rmdir(path)  # the claim; anything put in it meanwhile stays
      raise
  finally:
    shutil.rmtree(staging, ignore_errors=True)
