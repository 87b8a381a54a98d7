"""Sentence pairs tokenized once at preparation, then read memory-mapped.

A corpus is read and encoded once, when a run prepares it; every later start
or resume opens what was written, so its cost does not grow with the corpus
(docs/performance.md, "Input"). Each split is written to one folder as

  {split}.{side}.ids      every sentence's ids, one after another (uint16
                          where the vocabulary fits, else int32)
  {split}.{side}.offsets  int64[pairs + 1]: sentence i is ids[offsets[i]:
                          offsets[i + 1]]
  {split}.json            the pair count, the ids' dtype, the vocabulary's
                          size and a CRC-32 of each file, written last: a
                          split without it is incomplete and written again

for side 'src' and 'tgt'. Ids carry no specials (bos / eos are added when a
batch is made). Reading a batch touches only its rows' pages.
"""

import json
import os
import zlib
from typing import Iterable, Iterator

import numpy as np

from flaxformer_mini import disk
from flaxformer_mini.data import DataError

SIDES = ('src', 'tgt')
# Pairs encoded per call of the tokenizer: large enough for SentencePiece's
# threads, small enough that preparation's memory does not grow with the
# corpus.
CHUNK = 20_000


def _path(directory: str, split: str, name: str) -> str:
  return os.path.join(directory, f'{split}.{name}')


def ids_dtype(vocab_size: int) -> np.dtype:
  """The smallest dtype that holds every id: uint16 up to 65,536 pieces."""
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


class _Written:
  """A file written in pieces, with the CRC-32 of what was written."""

  def __init__(self, path: str):
    self.file, self.crc32 = open(path, 'wb'), 0

  def write(self, array: np.ndarray) -> None:
    data = np.ascontiguousarray(array).tobytes()
    self.file.write(data)
    self.crc32 = zlib.crc32(data, self.crc32)


def write_split(directory: str, split: str,
                chunks: Iterable[tuple[list, list]], vocab_size: int) -> None:
  """Writes a split from chunks of (source id lists, target id lists).

  What an interrupted write leaves is found incomplete (no {split}.json)
  and written again.
  """
  os.makedirs(directory, exist_ok=True)
  dtype = ids_dtype(vocab_size)
  status = _path(directory, split, 'json')
  if os.path.exists(status):
    os.remove(status)
  files = {}
  try:
    for side in SIDES:
      files[f'{side}.ids'] = _Written(_path(directory, split, f'{side}.ids'))
      files[f'{side}.offsets'] = _Written(
          _path(directory, split, f'{side}.offsets'))
      files[f'{side}.offsets'].write(np.zeros(1, np.int64))
    pairs, ends = 0, dict.fromkeys(SIDES, 0)
    for chunk in chunks:
      for side, sentences in zip(SIDES, chunk):
        lengths = np.fromiter(map(len, sentences), np.int64, len(sentences))
        if lengths.sum():
          files[f'{side}.ids'].write(np.concatenate(sentences).astype(dtype))
        files[f'{side}.offsets'].write(ends[side] + np.cumsum(lengths))
        ends[side] += int(lengths.sum())
      pairs += len(chunk[0])
  finally:
    for written in files.values():
      written.file.close()
  with disk.written_whole(status) as f:
    json.dump({'pairs': pairs, 'dtype': dtype.name, 'tokens': ends,
               'vocab_size': vocab_size,
               'crc32': {name: w.crc32 for name, w in files.items()}}, f)


def source_texts(source, indices, languages: tuple[str, str],
                 chunk: int = CHUNK) -> Iterator[tuple[list[str], list[str]]]:
  """(source texts, target texts) of a TFDS data source's pairs at `indices`
  (a sequence of ints), `chunk` pairs at a time.

  Lines are stripped as the local builder strips them, so a catalog dataset
  and local files read alike.
  """
  for start in range(0, len(indices), chunk):
    examples = source.__getitems__(list(indices[start:start + chunk]))
    yield tuple([e[lang].decode('utf-8').strip() for e in examples]
                for lang in languages)


def encoded_chunks(source, languages: tuple[str, str], tokenizer,
                   chunk: int = CHUNK) -> Iterator[tuple[list, list]]:
  """(source ids, target ids) of all of a TFDS data source's pairs, `chunk`
  pairs at a time."""
  threads = os.cpu_count() or 1
  for texts in source_texts(source, range(len(source)), languages, chunk):
    yield tuple(tokenizer.encode(side, num_threads=threads) for side in texts)


def is_complete(directory: str, split: str) -> bool:
  return os.path.isfile(_path(directory, split, 'json'))


class TokenizedSplit:
  """One split's pairs, memory-mapped: `pair(i)` -> (source ids, target ids).

  Opening it checks its files against the record: sizes, checksums (splits
  written since the record had them) and that no id lies past the
  vocabulary (`vocab_size`, else the record's), so that damaged ids are
  named here, not met as a NaN loss. One read of each file: about 0.1 s for
  WMT14's 135M tokens once they are in the page cache.

  Raises:
    DataError: the split is incomplete or damaged (naming the folder, the
      file and the way out).
  """

  def __init__(self, directory: str, split: str,
               vocab_size: int | None = None):
    self.directory, self.split = directory, split
    try:
      with open(_path(directory, split, 'json')) as f:
        record = json.load(f)
      self.pairs = record['pairs']
      self.ids, self.offsets = {}, {}
      for side in SIDES:
        self.offsets[side] = np.memmap(_path(directory, split,
                                             f'{side}.offsets'),
                                       np.int64, 'r')
        tokens = record['tokens'][side]
        self.ids[side] = (np.memmap(_path(directory, split, f'{side}.ids'),
                                    record['dtype'], 'r')
                          if tokens else np.zeros(0, record['dtype']))
        if (self.offsets[side].shape != (self.pairs + 1,) or
            self.ids[side].shape != (tokens,)):
          raise ValueError(f'{side} files do not match the record')
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise self._damaged(f'({e})') from None
    self._verify(record, vocab_size or record.get('vocab_size'))

  def _damaged(self, why: str) -> DataError:
    return DataError(
        f'{self.directory}: the tokenized {self.split} split is damaged '
        f'{why}; delete that folder and run again to tokenize it anew.')

  def _verify(self, record: dict, vocab_size: int | None) -> None:
    arrays = {f'{side}.{kind}': getattr(self, kind)[side]
              for side in SIDES for kind in ('ids', 'offsets')}
    for name, crc32 in record.get('crc32', {}).items():
      if zlib.crc32(arrays[name]) != crc32:
        raise self._damaged(f'({self.split}.{name} changed since it was '
                            'written: its checksum differs)')
    for side in SIDES:
      ids = self.ids[side]
      if vocab_size and len(ids) and int(ids.max()) >= vocab_size:
        raise self._damaged(f'({self.split}.{side}.ids holds id '
                            f'{int(ids.max())}, past the vocabulary of '
                            f'{vocab_size})')

  def __len__(self) -> int:
    return self.pairs

  def lengths(self) -> np.ndarray:
    """int32[pairs, 2]: each pair's (source, target) token count."""
    return np.stack([np.diff(self.offsets[side]).astype(np.int32)
                     for side in SIDES], axis=1)

  def pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(source ids, target ids) of pair `index`, without specials."""
    return tuple(
        self.ids[side][self.offsets[side][index]:
                       self.offsets[side][index + 1]]
        for side in SIDES)
