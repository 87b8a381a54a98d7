"""Lines of UTF-8 text, read one way wherever the project reads them.

A line ends at '\\n' alone: '\\r\\n' is the same end, and every other
character (a lone '\\r', U+2028, form feed, ...) stays inside its line, so
line i of one file is always line i of its translation, whatever counted
the lines. A UTF-8 byte-order mark at the start is dropped (Windows editors
write one); a line that is not UTF-8 is named by its number. The data
files (counted, then prepared: `parallel_text`) and the translate command's
input all go through here.
"""

import gzip
import zlib
from typing import Iterator

from flaxformer_mini.data import DataError

_BOM = b'\xef\xbb\xbf'
# What a damaged or mis-encoded text file raises while it is read.
_UNREADABLE = (UnicodeDecodeError, EOFError, zlib.error, gzip.BadGzipFile,
               OSError)


def _decoded(line: bytes, number: int, source: str) -> str:
  if number == 1:
    line = line.removeprefix(_BOM)
  try:
    return line.removesuffix(b'\n').removesuffix(b'\r').decode('utf-8')
  except UnicodeDecodeError:
    raise DataError(f'{source}: line {number} is not UTF-8 text; save it as '
                    'UTF-8.') from None


def split_lines(data: bytes, source: str) -> list[str]:
  """UTF-8 bytes -> their lines (a final '\\n' ends the text, no more).

  Raises:
    DataError: naming `source` and the line that is not UTF-8.
  """
  lines = data.split(b'\n')
  if lines[-1] == b'':
    lines.pop()
  return [_decoded(line, number, source)
          for number, line in enumerate(lines, start=1)]


def read_lines(path: str) -> Iterator[str]:
  """The lines of a text file, gzipped (.gz) or plain, one at a time.

  Raises:
    DataError: naming the file and the line that is not UTF-8, or where a
      damaged file stops reading.
  """
  opener = gzip.open if path.endswith('.gz') else open
  number = 0
  try:
    with opener(path, 'rb') as f:
      # Binary files iterate by b'\n' alone, whatever else a line holds.
      for number, line in enumerate(f, start=1):
        yield _decoded(line, number, path)
  except _UNREADABLE as e:
    first = str(e).splitlines()[0][:120] if str(e) else ''
    raise DataError(f'{path}: line {number + 1} is truncated or corrupt '
                    f'({type(e).__name__}: {first}); fix or replace the '
                    'file.') from None
