"""A training run's life in its workdir: resume or start, log, draw, report.

`TrainingRun.open` resumes the latest checkpoint of the same task and a
compatible config (`resume_or_start`), or starts afresh; the run's steps go
through `loop.train`; `close` waits for the last checkpoint and draws
curves.png from the logbook; `results` and `write_results` make the
results.json every task writes.
"""

import contextlib
import dataclasses
import time
from typing import Callable

import jax
import numpy as np

from flaxformer_mini import disk, logbook, loop, multihost, plots
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.checkpoints import (CheckpointError, Checkpoints,
                                         config_differences)
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.masks import Batch
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.training import TrainState, create_train_state
from flaxformer_mini.workdir import Workdir


class NothingToTrain(Exception):
  """The workdir's run is already at (and done with) --train_steps or past
  it: nothing is trained and nothing is written."""


def resume_or_start(config: TransformerConfig, checkpoints: Checkpoints,
                    parallel: DataParallel, task: str | None = None
                    ) -> tuple[TrainState, object, int]:
  """The latest checkpoint of a compatible run of `task`, or a fresh state.

  A run is its task and its config: checkpoints of another task (written
  with theirs, `Checkpoints(task=...)`) or of a config that differs in a
  field a resumed run may not change are refused. Returns (state, dropout
  key, the step resumed from or 0).

  Raises:
    CheckpointError: the checkpoints were written by another task or with a
      different config, or the latest one cannot be read.
  """
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  state = create_train_state(config, init_rng)
  latest = checkpoints.latest_step()
  if latest is None:
    return state, dropout_rng, 0
  meta = checkpoints.read_meta(latest)
  saved_task = meta.get('task')  # absent in checkpoints written before 2026-12
  if task is not None and saved_task not in (None, task):
    raise CheckpointError(
        f'{checkpoints.directory} holds checkpoints of a --task={saved_task} '
        f'run, not --task={task}; resume it with --task={saved_task}, or use '
        'another --workdir, or --fresh to set it aside and start over.')
  differences = config_differences(meta['config'], config)
  if differences:
    raise CheckpointError(
        f'{checkpoints.directory} holds checkpoints of another config ('
        + '; '.join(differences) + '). Use those values, another --workdir, '
        'or --fresh to set the old run aside and start over.')
  restored, meta = checkpoints.restore(latest, state, parallel.replicated)
  rng = jax.random.wrap_key_data(np.asarray(meta['rng'], np.uint32))
  return restored, rng, latest


@dataclasses.dataclass
class TrainingRun:
  """What one training run writes into its workdir, opened for the run."""
  task: str
  config: TransformerConfig
  workdir: Workdir
  parallel: DataParallel
  checkpoints: Checkpoints
  state: TrainState
  rng: jax.Array
  resumed_from: int
  log: logbook.Logbook | None  # None on processes other than the first
  timings: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def open(cls, task: str, config: TransformerConfig, workdir: Workdir,
           parallel: DataParallel) -> 'TrainingRun':
    """Resumes WORKDIR/checkpoints if they hold a run of `task`, else
    starts one."""
    checkpoints = Checkpoints(workdir.path_of(workdir_lib.CHECKPOINTS),
                              config.keep_checkpoints, writer=True, task=task)
    try:
      state, rng, resumed_from = resume_or_start(config, checkpoints,
                                                 parallel, task)
      _check_steps_left(config, workdir, resumed_from)
    except BaseException:
      checkpoints.close()
      raise
    if resumed_from:
      print(f'resuming from step {resumed_from} of {checkpoints.directory}')
    log = (logbook.Logbook(workdir.path, resumed_from)
           if jax.process_index() == 0 else None)
    return cls(task, config, workdir, parallel, checkpoints, state, rng,
               resumed_from, log)

  def train(self, batch_at: Callable[[int], Batch],
            evaluate: loop.Evaluate | None, signals: loop.SignalCatcher):
    """loop.train from the opened state; -> (final state, history)."""
    return loop.train(self.config, self.state, self.rng, batch_at, evaluate,
                      self.parallel, self.checkpoints, self.log, signals,
                      self.timings)

  def close(self, title: str, draw: bool = True) -> None:
    """Waits for the last checkpoint; closes the logbook and draws
    curves.png (unless not `draw`)."""
    self.checkpoints.close()
    if self.log is not None:
      self.log.close()
      if draw and logbook.read_records(self.workdir.path).get('train'):
        plots.training_curves(self.workdir.path, title)

  @contextlib.contextmanager
  def closing(self, title: str):
    """Closes the run (`close(title)`) after its training, however that
    ends; where the disk filled up, closes it without writing or drawing
    anything more, and raises disk.DiskFull."""
    try:
      yield self
    except BaseException as e:
      if multihost.lost_peer(e):
        raise  # the process ends at once: a save may wait for the lost one
      if not disk.is_full(e):
        self.close(title)
        raise
      with contextlib.suppress(Exception):  # the disk's error, met again
        self.close(title, draw=False)
      if isinstance(e, disk.DiskFull):
        raise
      raise disk.DiskFull(
          f'no space left on the disk of {self.workdir.path} (while writing '
          'the run\'s logs); free some and run the same command again.'
      ) from None
    self.close(title)

  def results(self, state: TrainState, history: list[dict],
              start_time: float, **outcome) -> dict:
    """What every run's results.json holds, with the task's `outcome`."""
    return {
        'task': self.task,
        'config': dataclasses.asdict(self.config),
        'devices': jax.device_count(),
        'processes': jax.process_count(),
        'steps': int(state.step),
        'resumed_from': self.resumed_from,
        'final_loss': history[-1]['loss'] if history else None,
        **outcome,
        'checkpoints': self.checkpoints.directory,
        'wall_seconds': time.perf_counter() - start_time,
        # From the start to the first step running: preparing (or finding)
        # the data, restoring and compiling.
        'seconds_to_first_step': (self.timings['first_step'] - start_time
                                  if 'first_step' in self.timings else None),
        'history': history,
    }

  def write_results(self, results: dict) -> str | None:
    """Writes WORKDIR/results.json (on the first process only, the one
    writer of a multi-host run); returns its path there."""
    if jax.process_index() == 0:
      return self.workdir.write_json(workdir_lib.RESULTS, results)
    return None


def _check_steps_left(config: TransformerConfig, workdir: Workdir,
                      resumed_from: int) -> None:
  """NothingToTrain where the run is past --train_steps, or at it with its
  results written (a run stopped during its final evaluation finishes it)."""
  try:
    results = workdir.read_json(workdir_lib.RESULTS) or {}
  except workdir_lib.WorkdirError:  # not whole: the run did not finish it
    results = {}
  done = resumed_from == config.train_steps and (
      results.get('steps') == resumed_from)
  if resumed_from > config.train_steps or done:
    raise NothingToTrain(
        f'--train_steps={config.train_steps}: the run in {workdir.path} is '
        f'already at step {resumed_from}'
        + (' with its results written' if done else '') +
        '; nothing to train (raise --train_steps to go on, or use --fresh or '
        'another --workdir to start over).')
