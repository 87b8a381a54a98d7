"""A run's folder: the names of its files, one run at a time, nothing lost
when starting over, and the one way to load a trained run.

    WORKDIR/
      .lock               held by the run that uses the folder (its pid inside)
      checkpoints/        orbax steps: resumed from by the next run
      averaged/           translation: the mean of the last checkpoints
      metrics.jsonl       every logged record; tensorboard/ the same as events
      results.json        the run's outcome; curves.png (and bleu.png) its curves
      spm.model           translation: the joint vocabulary (and spm.vocab)
      tfds/               translation: local data files prepared for TFDS
      prepared.json       what the vocabulary and tfds/ were made from
      set-aside-<time>/   what --fresh moved out of the way

A second run on the same folder is refused at once, naming the process that
holds it; the lock is the kernel's (flock), so a run killed with SIGKILL
leaves no lock behind. In a multi-host run the first process holds it.
Reading a run (`load_run`) takes no lock and writes nothing.
"""

import dataclasses
import fcntl
import json
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable

import jax

from flaxformer_mini import checkpoints as ckpt
from flaxformer_mini import disk
from flaxformer_mini.config import TransformerConfig

if TYPE_CHECKING:
  import sentencepiece


LOCK = '.lock'
CHECKPOINTS = 'checkpoints'
AVERAGED = 'averaged'
METRICS = 'metrics.jsonl'
TENSORBOARD = 'tensorboard'
RESULTS = 'results.json'
CURVES = 'curves.png'
BLEU_CURVE = 'bleu.png'
TOKENIZER = 'spm'  # the prefix of spm.model and spm.vocab
TFDS = 'tfds'
TOKENS = 'tokens'  # the tokenized splits (data/tokenized.py)
PREPARED = 'prepared.json'
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
    return read_json(self.path_of(name))

  def write_json(self, name: str, content: dict) -> str:
    """Writes WORKDIR/name (whole, or not at all); returns its path."""
    path = self.path_of(name)
    with disk.written_whole(path) as f:
      json.dump(content, f, indent=2)
    return path


def read_json(path: str) -> dict | None:
  """A JSON file the project wrote, or None where there is none.

  Raises:
    WorkdirError: the file is not whole JSON (cut short by a crash or a full
      disk, or edited), naming it.
  """
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise WorkdirError(f'{path} is damaged ({str(e)[:80]}); restore it from '
                       'a copy, or move it away to go on without it.') from None


# What load_run can load: the run's choice, its last checkpoint, its average.
WHICH = ('best', 'latest', 'averaged')


@dataclasses.dataclass(frozen=True)
class TrainedRun:
  """A trained run as `load_run` reads it.

  Attributes:
    config: the config it was trained with.
    params: the parameters, replicated over every device.
    which: 'latest' or 'averaged', the parameters loaded.
    step: the training step they come from.
    tokenizer: its vocabulary, a sentencepiece.SentencePieceProcessor
      (encode(text) -> ids without eos, decode(ids) -> text) for a
      translation run; None for the copy task.
  """
  config: TransformerConfig
  params: Any
  which: str
  step: int
  tokenizer: 'sentencepiece.SentencePieceProcessor | None'


def _chosen(path: str) -> str:
  """'averaged' or 'latest': what the run at `path` kept for translating."""
  try:
    results = read_json(os.path.join(path, RESULTS)) or {}
  except WorkdirError as e:
    # results.json only says which parameters scored better: a damaged one
    # costs that choice, not the run.
    print(f'warning: {e} Using the latest parameters.', file=sys.stderr)
    return 'latest'
  return results.get('translate_with', 'latest')


def load_run(path: str, which: str = 'best', sharding=None,
             params_shape=None) -> TrainedRun:
  """The trained run in the workdir `path`: its config, parameters, vocabulary.

  which: 'best' (what the run chose for translating: the averaged or the
  last parameters, whichever scored better on validation; 'latest' for a run
  that chose nothing), 'latest' (the last checkpoint) or 'averaged'. The
  config is the one saved with those parameters. Nothing in `path` is
  written, so a run may be read while it trains; a checkpoint that the
  training run deletes while it is read (it keeps only its last few) is
  replaced by the newest one. params_shape(config): the shapes and dtypes
  of the model's parameters, which the checkpoint is checked against
  (default `checkpoints.params_shape`, which traces the model's init;
  `compilation_cache.Executables.params_shape` keeps them on disk).

  Raises:
    WorkdirError: `path` is not a run's folder.
    CheckpointError: it holds no readable checkpoint of that kind.
    DataError: its vocabulary is damaged.
  """
  if which not in WHICH:
    raise ValueError(f'which={which!r}: allowed values: {", ".join(WHICH)}.')
  if not os.path.isdir(path):
    raise WorkdirError(f'--workdir={path}: no such folder; name the workdir '
                       'of a run trained with train.py.')
  if which == 'best':
    which = _chosen(path)
  directory = os.path.join(path, AVERAGED if which == 'averaged' else
                           CHECKPOINTS)
  if not os.path.isdir(directory):
    raise ckpt.CheckpointError(
        f'--workdir={path} holds no {os.path.basename(directory)}: '
        + ('train there with train.py first.' if which == 'latest' else
           'its run averaged no checkpoints; use its latest parameters.'))
  while True:
    with ckpt.Checkpoints(directory) as checkpoints:
      step = checkpoints.latest_step()
      if step is None:
        raise ckpt.CheckpointError(f'{directory} holds no complete '
                                   'checkpoint.')
      try:
        config = ckpt.saved_config(checkpoints.read_meta(step))
        params = checkpoints.restore_params(
            step, (params_shape or ckpt.params_shape)(config), sharding)
        break
      except ckpt.CheckpointError:
        if os.path.isdir(checkpoints.step_path(step)):
          raise
  vocabulary = os.path.join(path, TOKENIZER)
  tokenizer = None
  if os.path.isfile(vocabulary + '.model'):  # a translation run's
    # pylint: disable-next=g-import-not-at-top
    from flaxformer_mini.data import tokenizer as spm_lib
    tokenizer = spm_lib.load_tokenizer(vocabulary)
  return TrainedRun(config, params, which, step, tokenizer)
