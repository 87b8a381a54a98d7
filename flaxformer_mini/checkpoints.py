"""Checkpoints with orbax: save, resume exactly, average, load params only.

A training checkpoint is one orbax step directory with three items:
  params     the model parameters (StandardSave),
  opt_state  Adam's state (StandardSave),
  meta       JSON: step, config, the dropout key, the data position.
The data position is the step itself: every batch source of this project is a
pure function of (seed, step), so a resumed run sees exactly the batches the
uninterrupted run would have seen.

orbax writes each step into a temporary directory and renames it when it is
complete, so a process killed mid-write leaves the earlier steps readable;
leftover temporary directories are removed when the next run opens the
directory. Saving is asynchronous: the arrays are copied off the device, then
written in the background while training goes on.

Run `python -m flaxformer_mini.checkpoints average --workdir DIR --last K` to
average the parameters of the last K checkpoints (the paper averages the last
5 for base models, the last 20 for big ones).
"""

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.training import TrainState, init_params

# Fields that may change between a run and its resumption: how long and how
# often to log, evaluate and save, how the step is mapped over devices, and
# which kernel computes attention (the same parameters and function).
RESUMABLE_FIELDS = frozenset({
    'train_steps', 'max_train_minutes', 'log_every', 'eval_every',
    'checkpoint_every', 'keep_checkpoints', 'parallel',
    'attention_implementation'})
AVERAGED_DIR = 'averaged'


# orbax warns at every save without an evaluation score; most saves have none.
logging.getLogger('absl').addFilter(
    lambda record: 'tracked_metric' not in record.getMessage())


class CheckpointError(RuntimeError):
  """A checkpoint cannot be used; the message says why and what to do."""


def config_differences(saved: dict, config: TransformerConfig) -> list[str]:
  """'field: saved -> now' for each field that a resumed run may not change."""
  now = dataclasses.asdict(config)
  return [f'{name}: {saved.get(name)!r} -> {value!r}'
          for name, value in now.items()
          if name not in RESUMABLE_FIELDS and saved.get(name) != value]


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
  """The checkpoints of one run: keeps the last `keep` and the best one.

  `save` is asynchronous; `wait` blocks until every save is on disk.
  """

  def __init__(self, directory: str, keep: int = 3):
    self.directory = os.path.abspath(directory)
    policy = preservation_policy.AnyPreservationPolicy([
        preservation_policy.LatestN(keep),
        preservation_policy.BestN(
            get_metric_fn=lambda metrics: metrics['score'], n=1,
            keep_checkpoints_without_metrics=False),
    ])
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={'params': ocp.StandardCheckpointHandler(),
                       'opt_state': ocp.StandardCheckpointHandler(),
                       'meta': ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            preservation_policy=policy, cleanup_tmp_directories=True,
            # best_fn also makes orbax write the metrics to disk, so the best
            # checkpoint is still known after a restart.
            best_fn=lambda metrics: metrics['score'], best_mode='max',
            enable_async_checkpointing=True))

  def steps(self) -> list[int]:
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
    """Starts saving `state` as `step` (with an evaluation score, if any)."""
    meta = {'step': step, 'config': dataclasses.asdict(config),
            'rng': np.asarray(jax.random.key_data(rng)).tolist(),
            'data_position': {'step': step}}
    self.manager.save(
        step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            meta=ocp.args.JsonSave(meta)),
        metrics=None if score is None else {'score': float(score)},
        force=True)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def read_meta(self, step: int) -> dict:
    try:
      return self.manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))['meta']
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from e

  def _unreadable(self, step: int, error: Exception) -> CheckpointError:
    earlier = [s for s in self.steps() if s < step]
    fallback = (f'move {self.step_path(step)} away to resume from step '
                f'{earlier[-1]}' if earlier else
                f'remove {self.step_path(step)} (no earlier checkpoint)')
    return CheckpointError(
        f'checkpoint {self.step_path(step)} could not be read; it is truncated '
        f'or corrupted ({type(error).__name__}: {str(error)[:300]}). To go '
        f'on, {fallback}, or start again with --fresh.')

  def _check_shapes(self, step: int, item: str, expected) -> None:
    try:
      saved = self.manager.item_metadata(step)[item]
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from e
    saved_tree = saved.tree if hasattr(saved, 'tree') else saved
    problems = _shape_mismatches(saved_tree, expected)
    if problems:
      raise CheckpointError(
          f'checkpoint {self.step_path(step)} does not fit this model '
          f'({item}): ' + '; '.join(problems[:5]) +
          ('; ...' if len(problems) > 5 else '') +
          '. Use the config it was written with, or start again with --fresh.')

  def restore(self, step: int, like: TrainState, sharding) -> tuple[
      TrainState, dict]:
    """Restores step `step` into the structure of `like`.

    The arrays are placed with `sharding` (e.g. replicated over the current
    mesh), whatever devices wrote them: 8 devices restore on 1 and back.
    Returns (state, meta).
    """
    self._check_shapes(step, 'params', like.params)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_abstract(like.params, sharding)),
          opt_state=ocp.args.StandardRestore(
              _abstract(like.opt_state, sharding)),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from e
    meta = restored['meta']
    state = like.replace(step=meta['step'], params=restored['params'],
                         opt_state=restored['opt_state'])
    return state, meta

  def restore_params(self, step: int, like_params, sharding=None):
    """Only the parameters of `step` (for inference)."""
    self._check_shapes(step, 'params', like_params)
    try:
      return self.manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_abstract(like_params, sharding))
      ))['params']
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from e

  def close(self) -> None:
    self.manager.close()


def set_aside(directory: str) -> str | None:
  """Renames an existing checkpoint directory (for --fresh); returns the new name."""
  if not os.path.isdir(directory):
    return None
  target = f'{directory}.set-aside-{time.strftime("%Y%m%d-%H%M%S")}'
  os.rename(directory, target)
  return target


def average_params(checkpoints: Checkpoints, last: int, like_params):
  """The mean of the parameters of the last `last` checkpoints.

  Returns (params, the steps averaged).
  """
  steps = checkpoints.steps()[-last:]
  if len(steps) < last:
    raise CheckpointError(
        f'--last={last}: only {len(steps)} checkpoint(s) in '
        f'{checkpoints.directory} ({steps}); raise --keep_checkpoints or '
        'average fewer.')
  total = None
  for step in steps:
    params = checkpoints.restore_params(step, like_params)
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    total = params if total is None else jax.tree.map(np.add, total, params)
  mean = jax.tree.map(
      lambda s, ref: (s / len(steps)).astype(ref.dtype), total, like_params)
  return mean, steps


def save_params(directory: str, params, config: TransformerConfig,
                note: dict) -> None:
  """Writes a params-only checkpoint (params + config.json) to `directory`."""
  directory = os.path.abspath(directory)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(directory, 'params'), params, force=True)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump({'config': dataclasses.asdict(config), **note}, f, indent=2)


def load_params(path: str, config: TransformerConfig, sharding=None):
  """Parameters for inference from a params-only or a training checkpoint.

  path: a directory written by `save_params` (e.g. WORKDIR/averaged), or a
  run's checkpoint directory (WORKDIR/checkpoints: its latest step is used).
  No optimizer state is read.
  """
  like = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  params_dir = os.path.join(os.path.abspath(path), 'params')
  if os.path.isfile(os.path.join(path, 'config.json')):
    with ocp.StandardCheckpointer() as checkpointer:
      saved = checkpointer.metadata(params_dir)
      saved_tree = saved.item_metadata if hasattr(
          saved, 'item_metadata') else saved
      saved_tree = saved_tree.tree if hasattr(saved_tree, 'tree') else saved_tree
      problems = _shape_mismatches(saved_tree, like)
      if problems:
        raise CheckpointError(f'{params_dir} does not fit this model: ' +
                              '; '.join(problems[:5]))
      return checkpointer.restore(params_dir, _abstract(like, sharding))
  if not os.path.isdir(path):
    raise CheckpointError(f'no checkpoint at {path}: expected a run\'s '
                          'checkpoints directory or a params-only directory.')
  checkpoints = Checkpoints(path)
  step = checkpoints.latest_step()
  if step is None:
    raise CheckpointError(f'{path} holds no complete checkpoint.')
  return checkpoints.restore_params(step, like, sharding)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog='python -m flaxformer_mini.checkpoints',
      description='Averages the parameters of a run\'s last K checkpoints '
      'into WORKDIR/averaged, a params-only checkpoint for inference.')
  parser.add_argument('command', choices=['average'])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--last', type=int, default=5)
  args = parser.parse_args(argv)
  directory = os.path.join(args.workdir, 'checkpoints')
  if not os.path.isdir(directory):
    parser.error(f'--workdir={args.workdir}: no checkpoints directory there.')
  checkpoints = Checkpoints(directory)
  latest = checkpoints.latest_step()
  if latest is None:
    parser.error(f'{directory} holds no complete checkpoint.')
  config = TransformerConfig(**checkpoints.read_meta(latest)['config'])
  like = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  try:
    params, steps = average_params(checkpoints, args.last, like)
  except CheckpointError as e:
    parser.error(str(e))
  target = os.path.join(args.workdir, AVERAGED_DIR)
  save_params(target, params, config, {'averaged_steps': steps})
  print(f'averaged steps {steps} into {os.path.abspath(target)}')


if __name__ == '__main__':
  main(sys.argv[1:])
