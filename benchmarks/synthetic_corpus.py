"""A deterministic parallel corpus of any size, made of Multi30k's sentences.

WMT14 English-German has 4.5M training pairs of about 23 words a side; no
such corpus can be downloaded here. This writes one of the same size and
shape in the local layout train.py reads (plain train.{de,en} files, and
Multi30k's own val and test files): pair i joins 1 to 3 Multi30k training
pairs drawn by a seeded generator (about 25 words a side), so the text is
real, the alignment holds, and every pair is new.

  python benchmarks/synthetic_corpus.py DATA_DIR OUT_DIR --pairs=4500000
"""

import argparse
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flaxformer_mini.data.lines import read_lines  # pylint: disable=g-import-not-at-top,wrong-import-position

LANGUAGES = ('de', 'en')
BLOCK = 100_000  # pairs drawn and written at a time


def write(data_dir: str, out_dir: str, pairs: int, seed: int = 0) -> None:
  """Writes OUT_DIR/train.{de,en} (`pairs` lines) and copies val and test."""
  os.makedirs(out_dir, exist_ok=True)
  sentences = {lang: np.array([line.strip() for line in read_lines(
      os.path.join(data_dir, f'train.{lang}.gz'))], dtype=object)
               for lang in LANGUAGES}
  count = len(sentences['de'])
  rng = np.random.default_rng(seed)
  files = {lang: open(os.path.join(out_dir, f'train.{lang}.part'), 'w',
                      encoding='utf-8') for lang in LANGUAGES}
  for start in range(0, pairs, BLOCK):
    size = min(BLOCK, pairs - start)
    parts = rng.integers(1, 4, size)
    chosen = rng.integers(0, count, (size, 3))
    for lang, f in files.items():
      f.write(''.join(
          ' '.join(sentences[lang][chosen[i, :parts[i]]]) + '\n'
          for i in range(size)))
  for lang, f in files.items():
    f.close()
    os.replace(os.path.join(out_dir, f'train.{lang}.part'),
               os.path.join(out_dir, f'train.{lang}'))
  for name in os.listdir(data_dir):
    if name.startswith(('val.', 'test_')) and name.split('.')[1] in LANGUAGES:
      shutil.copy(os.path.join(data_dir, name), out_dir)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('data_dir', help='Multi30k task-1 raw files.')
  parser.add_argument('out_dir')
  parser.add_argument('--pairs', type=int, default=4_500_000)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  write(args.data_dir, args.out_dir, args.pairs, args.seed)
  print(f'{args.pairs} pairs in {args.out_dir}')


if __name__ == '__main__':
  main()
