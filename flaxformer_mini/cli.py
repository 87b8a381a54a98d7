"""What the project's commands share: argparse whose errors are one line.

train.py, the translate command and the tour refuse a bad flag with one line
that names it (`train.py: error: --beam_size: 0: must be at least 1`), never a
usage block or a traceback.
"""

import argparse
import importlib.util
import math
import os

from flaxformer_mini import disk

# What `pip install '.[translate]'` adds, by import name (array_record, the
# prepared data's format, comes with grain, a dependency of every install).
TRANSLATION_MODULES = ('tensorflow_datasets', 'sentencepiece', 'sacrebleu')


class OneLineParser(argparse.ArgumentParser):
  """argparse, but an error is one line naming the flag (no usage block)."""

  def error(self, message):
    self.exit(2, f'{self.prog}: error: {message}\n')


def missing_translation_extras() -> str | None:
  """None where translation's extra dependencies are installed; else the
  error line that says how to install them. Found, not imported: the
  translate command never uses TFDS, and importing it costs half a second."""
  for name in TRANSLATION_MODULES:
    if importlib.util.find_spec(name) is None:
      return (f'translation needs {name}, one of its extra dependencies: '
              "install them with pip install -e '.[translate]' (in a clone) "
              "or pip install 'flaxformer_mini[translate]'.")
  return None


def load_translation_run(parser, workdir: str, which: str,
                         params_shape=None):
  """The trained translation run in `workdir` (`workdir.load_run`, with
  its params_shape), or the parser's one-line error naming what is missing
  or damaged there."""
  # pylint: disable=g-import-not-at-top
  from flaxformer_mini import workdir as workdir_lib
  from flaxformer_mini.checkpoints import CheckpointError
  from flaxformer_mini.data import DataError
  # pylint: enable=g-import-not-at-top
  vocabulary = workdir_lib.TOKENIZER + '.model'
  if not os.path.isfile(os.path.join(workdir, vocabulary)):
    parser.error(f'--workdir={workdir}: no {vocabulary} there; train '
                 'with train.py --task=translate first.')
  try:
    return workdir_lib.load_run(workdir, which, params_shape=params_shape)
  except (CheckpointError, DataError, workdir_lib.WorkdirError) as e:
    parser.error(str(e))


def out_error(out: str, error: OSError) -> str:
  """The error line for --out=`out`, a new folder (`disk.new_folder`), that
  `error` (disk.FolderExists or another OSError) refused."""
  if isinstance(error, disk.FolderExists):
    return f'--out={error}'
  return f'--out={out}: cannot be written ({error.strerror}).'


def positive_int(text: str) -> int:
  """An argparse type: an integer of at least 1."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f'{value}: must be at least 1')
  return value


def non_negative_float(text: str) -> float:
  """An argparse type: a finite number of at least 0."""
  value = finite_float(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f'{text}: must be at least 0')
  return value


def probability(text: str) -> float:
  """An argparse type: a number in (0, 1]."""
  value = finite_float(text)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f'{text}: must lie in (0, 1]')
  return value


def finite_float(text: str) -> float:
  """An argparse type: a number that is neither nan nor infinite."""
  value = float(text)
  if not math.isfinite(value):
    raise argparse.ArgumentTypeError(f'{text}: must be a finite number')
  return value
