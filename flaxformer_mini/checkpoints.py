"""Checkpoints with orbax: save, resume exactly, verify, average, load params only.

A training checkpoint is one orbax step directory with three items:
  params     the model parameters (StandardSave),
  opt_state  Adam's state (StandardSave),
  meta       JSON: step, the task, config, the dropout key, the data
             position, and a CRC-32 of every saved array.
The data position is the step itself: every batch source of this project is a
pure function of (seed, step), so a resumed run sees exactly the batches the
uninterrupted run would have seen. The checksums are verified on restore, so
a checkpoint whose bytes changed on disk is refused, not silently used.

Averaged parameters (WORKDIR/averaged) are the same kind of directory with
only `params` and `meta`.

orbax writes each step into a temporary directory and renames it when it is
complete, so a process killed mid-write leaves the earlier steps readable.
Only a run that writes (and holds its workdir's lock) opens the directory with
`writer=True`, which also removes the temporary directories a killed run left
behind; everything that only reads (the translate command, the tour,
averaging) opens it read-only, so it never touches a save in flight in
another process. Saving is asynchronous: the arrays are copied off the
device, then written in the background while training goes on.
"""

import contextlib
import dataclasses
import logging
import os
import zlib

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

from flaxformer_mini import disk
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.parallel import replicated_sharding
from flaxformer_mini.training import TrainState, init_params

# Fields that may change between a run and its resumption: how long (and so
# where the learning rate cools down), how often to log, evaluate and save,
# how the products are computed (the same values), in how many
# micro-batches an update's batch is taken (the same update and optimizer
# state, on a machine with fewer or more devices), and when the
# evaluations' beam searches stop (the same translations but for one or two
# in a thousand; a run saved under the old default resumes under the new).
RESUMABLE_FIELDS = frozenset({
    'train_steps', 'cooldown_steps', 'max_train_minutes', 'log_every',
    'eval_every', 'checkpoint_every', 'keep_checkpoints', 'cpu_kernels',
    'average_last', 'grad_accumulation', 'eval_stopping'})

# What a run saved before a field existed did, where the field's default
# has since changed.
_BEFORE_THE_FIELD = {'eval_stopping': 'exact'}


class _QuietOrbax(logging.Filter):
  """orbax warns at every save without an evaluation score (most have none)
  and whenever a directory is opened read-only (as every reader here does);
  it logs a full disk from each of its writer threads, which the run reports
  once, as disk.DiskFull."""

  def filter(self, record):
    message = record.getMessage()
    return ('tracked_metric' not in message and
            'directory is read only' not in message and
            not any(words in message for words in disk.WORDS))


_QUIET = _QuietOrbax()


class CheckpointError(RuntimeError):
  """A checkpoint cannot be used; the message says why and what to do."""


def config_differences(saved: dict, config: TransformerConfig) -> list[str]:
  """'field: saved -> now' for each field that a resumed run may not change.

  A field the saved config lacks (written before the field existed) counts
  as its default.
  """
  now = dataclasses.asdict(config)
  defaults = dataclasses.asdict(TransformerConfig())
  return [f'{name}: {saved.get(name, defaults[name])!r} -> {value!r}'
          for name, value in now.items()
          if name not in RESUMABLE_FIELDS and
          saved.get(name, defaults[name]) != value]


def checksums(tree) -> dict[str, int]:
  """{leaf path: CRC-32 of its bytes} of a pytree of (replicated) arrays."""
  def host(leaf):
    if isinstance(leaf, jax.Array):
      leaf = leaf.addressable_data(0)  # this process's full copy
    return np.ascontiguousarray(np.asarray(leaf))
  return {jax.tree_util.keystr(path): zlib.crc32(host(leaf).tobytes())
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _shape_mismatches(saved_tree, expected_tree) -> list[str]:
  """'path: saved shape vs expected shape' for leaves that differ."""
  saved = {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in
           jax.tree_util.tree_leaves_with_path(saved_tree)}
  expected = {jax.tree_util.keystr(path): tuple(np.shape(leaf)) for path, leaf
              in jax.tree_util.tree_leaves_with_path(expected_tree)}
  problems = [f'{key}: missing in the checkpoint'
              for key in sorted(expected.keys() - saved.keys())]
  problems += [f'{key}: not in the model' for key in
               sorted(saved.keys() - expected.keys())]
  problems += [f'{key}: saved {saved[key]}, model {expected[key]}'
               for key in sorted(saved.keys() & expected.keys())
               if saved[key] != expected[key]]
  return problems


def _abstract(tree, sharding):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
      tree)


class Checkpoints:
  """The checkpoints of one run, opened read-only unless `writer`.

  A writer keeps the last `keep` steps and the best evaluated one, writes
  its run's `task` into each step's meta, and removes the temporary
  directories of saves that never finished: only the run that holds the
  workdir may open it so. A reader changes nothing on
  disk. `save` is asynchronous; `wait` blocks until every save is on disk.
  Use it as a context manager (or call `close`), so that orbax's threads end.
  """

  def __init__(self, directory: str, keep: int = 3, writer: bool = False,
               task: str | None = None):
    self.directory = os.path.abspath(directory)
    self.writer, self.task = writer, task
    policy = preservation_policy.AnyPreservationPolicy([
        preservation_policy.LatestN(keep),
        preservation_policy.BestN(
            get_metric_fn=lambda metrics: metrics['score'], n=1,
            keep_checkpoints_without_metrics=False),
    ])
    logging.getLogger('absl').addFilter(_QUIET)  # added once, however often
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={'params': ocp.StandardCheckpointHandler(),
                       'opt_state': ocp.StandardCheckpointHandler(),
                       'meta': ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            preservation_policy=policy, read_only=not writer,
            cleanup_tmp_directories=writer, create=writer,
            # A reader saves nothing (0 also keeps orbax from saying so).
            save_interval_steps=1 if writer else 0,
            # best_fn also makes orbax write the metrics to disk, so the best
            # checkpoint is still known after a restart.
            best_fn=lambda metrics: metrics['score'], best_mode='max',
            enable_async_checkpointing=True))

  def __enter__(self) -> 'Checkpoints':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def steps(self) -> list[int]:
    """The complete steps on disk, oldest first."""
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def best_step(self) -> int | None:
    """The step with the highest evaluation score, if any was scored."""
    scored = [(self.manager.metrics(step), step) for step in self.steps()]
    scored = [(m['score'], step) for m, step in scored if m]
    return max(scored)[1] if scored else None

  def step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: TrainState, rng, config: TransformerConfig,
           score: float | None = None) -> None:
    """Starts saving `state` as `step` (with an evaluation score, if any).

    Raises:
      disk.DiskFull: the disk has no room for it (checked before anything
        is written), or filled up while the previous save was written.
    """
    self._check_writer()
    # orbax waits for the previous save before it starts this one: wait
    # first, so that the room is measured with that one on disk.
    self.wait()
    self._check_room(step, (state.params, state.opt_state))
    meta = {'step': step, 'task': self.task,
            'config': dataclasses.asdict(config),
            'rng': np.asarray(jax.random.key_data(rng)).tolist(),
            'data_position': {'step': step},
            'checksums': {'params': checksums(state.params),
                          'opt_state': checksums(state.opt_state)}}
    with self._disk_full_as_one_error(step):
      self.manager.save(
          step, args=ocp.args.Composite(
              params=ocp.args.StandardSave(state.params),
              opt_state=ocp.args.StandardSave(state.opt_state),
              meta=ocp.args.JsonSave(meta)),
          metrics=None if score is None else {'score': float(score)},
          force=True)

  def _check_room(self, step: int, arrays) -> None:
    """DiskFull, before orbax writes a byte, where `arrays` will not fit.

    A checkpoint takes about its arrays' bytes; the margin leaves room for
    orbax's metadata and the run's logs. (Failing inside orbax's writer
    threads is noisier and leaves a partial step behind.)
    """
    need = int(sum(leaf.nbytes for leaf in jax.tree.leaves(arrays)) * 1.1
               ) + (1 << 20)
    free = disk.free_bytes(self.directory)
    if free < need:
      raise self._disk_full(
          f'checkpoint {step} needs about {need / 2**20:.1f} MB, '
          f'{free / 2**20:.1f} MB are free')

  def _disk_full(self, why: str) -> disk.DiskFull:
    intact = intact_steps(self.directory)
    return disk.DiskFull(
        f'no space left on the disk of {self.directory} ({why}); free some '
        'and run the same command again: ' +
        (f'the checkpoints up to step {max(intact)} are intact.' if intact
         else 'no checkpoint was written yet.'))

  @contextlib.contextmanager
  def _disk_full_as_one_error(self, step: int | None = None):
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      if not disk.is_full(e):
        raise
      what = f'while writing step {step}' if step else 'while writing'
      raise self._disk_full(f'it filled up {what}') from None

  def save_params(self, step: int, params, config: TransformerConfig,
                  note: dict) -> None:
    """Saves parameters alone (e.g. averaged ones) as `step`, with `note`."""
    self._check_writer()
    self.wait()
    self._check_room(step, params)
    meta = {'step': step, 'config': dataclasses.asdict(config),
            'checksums': {'params': checksums(params)}, **note}
    if step in self.manager.all_steps():  # e.g. averaged again after a rerun
      self.manager.delete(step)
    with self._disk_full_as_one_error(step):
      self.manager.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(params),
          meta=ocp.args.JsonSave(meta)), force=True)

  def _check_writer(self) -> None:
    if not self.writer:  # orbax would skip the save without a word
      raise ValueError(f'{self.directory} is open read-only; open it with '
                       'writer=True to save.')

  def wait(self) -> None:
    """Blocks until every save is on disk (disk.DiskFull where the disk
    filled up while writing one)."""
    with self._disk_full_as_one_error():
      self.manager.wait_until_finished()

  def read_meta(self, step: int) -> dict:
    """The meta item of `step`; CheckpointError if it cannot be read."""
    try:
      return self.manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))['meta']
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from None

  def _unreadable(self, step: int, error: Exception | str) -> CheckpointError:
    earlier = [s for s in self.steps() if s < step]
    fallback = (f'move {self.step_path(step)} away to use step {earlier[-1]}'
                if earlier else
                f'remove {self.step_path(step)} (no earlier checkpoint)')
    why = (error if isinstance(error, str) else
           f'it is truncated or corrupted ({type(error).__name__}: '
           f'{str(error)[:300]})')
    return CheckpointError(f'checkpoint {self.step_path(step)} could not be '
                           f'read; {why}. To go on, {fallback}.')

  def _check_shapes(self, step: int, item: str, expected) -> None:
    try:
      saved = self.manager.item_metadata(step)[item]
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from None
    saved_tree = saved.tree if hasattr(saved, 'tree') else saved
    problems = _shape_mismatches(saved_tree, expected)
    if problems:
      raise CheckpointError(
          f'checkpoint {self.step_path(step)} does not fit this model '
          f'({item}): ' + '; '.join(problems[:5]) +
          ('; ...' if len(problems) > 5 else '') +
          '. Use the config it was written with.')

  def _verify(self, step: int, meta: dict, restored: dict) -> None:
    """Compares the restored arrays with the checksums saved in meta."""
    for item, saved in meta.get('checksums', {}).items():
      now = checksums(restored[item])
      changed = sorted(k for k in saved if now.get(k) != saved[k])
      if changed:
        raise self._unreadable(
            step, f'{len(changed)} array(s) of {item} differ from what was '
            f'saved (first: {item}{changed[0]}): its files changed on disk')

  def restore(self, step: int, like: TrainState, sharding=None) -> tuple[
      TrainState, dict]:
    """Restores step `step` into the structure of `like`.

    The arrays are placed with `sharding` (default: replicated over every
    device of the data mesh), whatever devices wrote them: 8 devices restore on 1 and back.
    Returns (state, meta). Raises CheckpointError where the checkpoint does
    not fit `like`, cannot be read, or differs from what was saved.
    """
    sharding = sharding or replicated_sharding()
    self._check_shapes(step, 'params', like.params)
    multi_steps = self._saved_in_multi_steps(step)
    opt_state = like.opt_state
    if multi_steps:
      opt_state = jax.eval_shape(optax.MultiSteps(like.tx, 2).init,
                                 like.params)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_abstract(like.params, sharding)),
          opt_state=ocp.args.StandardRestore(_abstract(opt_state, sharding)),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from None
    meta = restored['meta']
    self._verify(step, meta, restored)
    opt_state = restored['opt_state']
    if multi_steps:
      opt_state = opt_state.inner_opt_state
    state = like.replace(step=meta['step'], params=restored['params'],
                         opt_state=opt_state)
    return state, meta

  def _saved_in_multi_steps(self, step: int) -> bool:
    """Whether `step` holds its optimizer state in optax.MultiSteps' layout.

    Versions up to e577ba4 accumulated the gradients of
    grad_accumulation > 1 in MultiSteps, which wraps Adam's state; saved
    between two updates, its accumulator is empty and Adam's state
    (inner_opt_state) is all a resumed run needs.
    """
    try:
      saved = self.manager.item_metadata(step)['opt_state']
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from None
    saved_tree = saved.tree if hasattr(saved, 'tree') else saved
    return isinstance(saved_tree, dict) and 'inner_opt_state' in saved_tree

  def restore_params(self, step: int, like_params, sharding=None):
    """Only the parameters of `step` (for inference), verified."""
    sharding = sharding or replicated_sharding()
    self._check_shapes(step, 'params', like_params)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_abstract(like_params, sharding)),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from None
    self._verify(step, {'checksums': {
        'params': restored['meta'].get('checksums', {}).get('params', {})}},
                 restored)
    return restored['params']

  def close(self) -> None:
    with self._disk_full_as_one_error():
      self.manager.close()


def intact_steps(directory: str) -> list[int]:
  """The complete steps in a folder of checkpoints, oldest first, read from
  the folder alone (no orbax manager: safe in a run that is failing).

  orbax renames a step's temporary folder to its number once it is whole.
  """
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def saved_config(meta: dict) -> TransformerConfig:
  """The config saved in a checkpoint's meta (fields it lacks: what the run
  did before they existed, else their defaults; fields since removed:
  dropped)."""
  known = {f.name for f in dataclasses.fields(TransformerConfig)}
  return TransformerConfig(**{**_BEFORE_THE_FIELD,
                              **{k: v for k, v in meta['config'].items()
                                 if k in known}})


def params_shape(config: TransformerConfig):
  """The parameters of Transformer(config) as shapes and dtypes, no arrays."""
  return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def average_params(checkpoints: Checkpoints, last: int, like_params):
  """The mean of the parameters of the last `last` checkpoints.

  Returns (params, the steps averaged). Raises CheckpointError where fewer
  than `last` are on disk or one cannot be read.
  """
  steps = checkpoints.steps()[-last:]
  if len(steps) < last:
    raise CheckpointError(
        f'average_last={last}: only {len(steps)} checkpoint(s) in '
        f'{checkpoints.directory} ({steps}); raise keep_checkpoints or '
        'average fewer.')
  total = None
  for step in steps:
    params = checkpoints.restore_params(step, like_params)
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    total = params if total is None else jax.tree.map(np.add, total, params)
  mean = jax.tree.map(
      lambda s, ref: (s / len(steps)).astype(ref.dtype), total, like_params)
  return mean, steps


def load_params(directory: str, config: TransformerConfig,
                step: int | None = None, sharding=None):
  """Parameters for inference from a directory of checkpoints.

  directory: e.g. WORKDIR/checkpoints or WORKDIR/averaged; its latest step
  unless `step` is given. No optimizer state is read, and nothing is
  written. Raises CheckpointError. (`workdir.load_run` loads a whole run.)
  """
  if not os.path.isdir(directory):
    raise CheckpointError(f'no checkpoint at {directory}.')
  with Checkpoints(directory) as checkpoints:
    step = checkpoints.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f'{directory} holds no complete checkpoint.')
    return checkpoints.restore_params(step, params_shape(config), sharding)
