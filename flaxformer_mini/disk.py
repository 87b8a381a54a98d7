"""Running out of disk, for every writer of a run: one error, one line.

A full disk (or a quota, or a file-size limit) shows up in many forms: an
OSError from Python, a RESOURCE_EXHAUSTED ValueError from orbax's
TensorStore, a RuntimeError from TFDS, a SentencePiece model cut short.
`is_full` recognises them; `DiskFull` is what the run raises instead, naming
the folder and what to do, and train.py prints it as one line.
"""

import errno
import shutil

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
