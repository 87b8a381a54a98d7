"""Checkpoints: exact resume, interruption, damage, NaN guard, averaging, devices."""

import dataclasses
import functools
import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_mini import checkpoints as ckpt
from flaxformer_mini import loop, run
from flaxformer_mini.config import get_config
from flaxformer_mini.data import copy_task
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.training import create_train_state
from flaxformer_mini.workdir import AVERAGED, load_run

# Whole training runs: saved, resumed, damaged, interrupted.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def cfg():
  # Dropout on, so that the resumed run must also restore the dropout key.
  return get_config('copy').replace(copy_length=5, batch_size=16,
                                    dropout_rate=0.1, log_every=5,
                                    eval_every=10_000, checkpoint_every=10)


def _train_in(workdir, cfg):
  """loop.train as the copy task runs it, without the final evaluation."""
  parallel = DataParallel(cfg)
  with ckpt.Checkpoints(os.path.join(workdir, 'checkpoints'),
                        cfg.keep_checkpoints, writer=True) as checkpoints:
    state, rng, resumed = run.resume_or_start(cfg, checkpoints, parallel)
    state, _ = loop.train(
        cfg, state, rng, functools.partial(copy_task.train_batch, cfg),
        parallel=parallel, checkpoints=checkpoints)
  return state, resumed


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.versions
def test_a_resumed_run_is_the_uninterrupted_run_bitwise(tmp_path, cfg):
  whole, _ = _train_in(tmp_path / 'whole', cfg.replace(train_steps=40))
  _, resumed_from = _train_in(tmp_path / 'split', cfg.replace(train_steps=20))
  assert resumed_from == 0
  second, resumed_from = _train_in(tmp_path / 'split',
                                   cfg.replace(train_steps=40))
  assert resumed_from == 20 and int(second.step) == 40
  for a, b in zip(_leaves(whole.params) + _leaves(whole.opt_state),
                  _leaves(second.params) + _leaves(second.opt_state)):
    np.testing.assert_array_equal(a, b)


def test_keeps_the_last_k_and_the_best(tmp_path, cfg):
  checkpoints = ckpt.Checkpoints(str(tmp_path), keep=2, writer=True)
  state = create_train_state(cfg, jax.random.key(0))
  for step, score in [(1, 0.5), (2, 0.9), (3, 0.1), (4, None), (5, 0.2)]:
    checkpoints.save(step, state, jax.random.key(1), cfg, score)
  checkpoints.wait()
  assert checkpoints.steps() == [2, 4, 5]
  assert checkpoints.best_step() == 2
  checkpoints.close()


def test_a_workdir_of_another_config_is_refused_naming_the_fields(tmp_path,
                                                                   cfg):
  _train_in(tmp_path, cfg.replace(train_steps=10))
  with pytest.raises(ckpt.CheckpointError,
                     match=r'd_ff: 64 -> 128.*--fresh'):
    _train_in(tmp_path, cfg.replace(train_steps=20, d_ff=128))
  # train_steps, cooldown_steps, log_every, ... may change: that is how a
  # run is extended, or given a cool-down at its new end.
  _train_in(tmp_path, cfg.replace(train_steps=20, log_every=10,
                                  cooldown_steps=5))


@pytest.mark.parametrize('before, after', [(1, 2), (2, 1)])
def test_a_run_resumes_with_other_micro_batches_and_the_same_updates(
    tmp_path, cfg, before, after):
  # No dropout: the micro-batches would draw other masks than the batch.
  cfg = cfg.replace(dropout_rate=0.0)
  whole, _ = _train_in(tmp_path / 'whole',
                       cfg.replace(train_steps=20, grad_accumulation=before))
  _train_in(tmp_path / 'split', cfg.replace(train_steps=10,
                                            grad_accumulation=before))
  second, resumed_from = _train_in(
      tmp_path / 'split', cfg.replace(train_steps=20, grad_accumulation=after))
  assert resumed_from == 10 and int(second.step) == 20
  # The same updates, up to the order in which the micro-batches' sums add.
  for a, b in zip(_leaves(whole.params), _leaves(second.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_run_of_another_task_is_refused_naming_it(tmp_path, cfg):
  """A run is its task and its config: a copy run pointed at the workdir of
  another task with the same preset (a reversal task, say) is refused in one
  line, not resumed and overwritten."""
  cfg = cfg.replace(train_steps=5)
  parallel = DataParallel(cfg)
  directory = str(tmp_path / 'checkpoints')
  with ckpt.Checkpoints(directory, writer=True, task='reverse') as written:
    state, rng, _ = run.resume_or_start(cfg, written, parallel, 'reverse')
    loop.train(cfg, state, rng, functools.partial(copy_task.train_batch, cfg),
               parallel=parallel, checkpoints=written)
  with ckpt.Checkpoints(directory, writer=True, task='copy') as checkpoints:
    with pytest.raises(ckpt.CheckpointError, match=(
        r'holds checkpoints of a --task=reverse run, not --task=copy; resume '
        r'it with --task=reverse, or use another --workdir, or --fresh')):
      run.resume_or_start(cfg, checkpoints, parallel, 'copy')
    assert run.resume_or_start(cfg, checkpoints, parallel, 'reverse')[2] == 5


def test_fields_added_later_count_as_their_default_on_resumption(cfg):
  # Checkpoints written before a field existed resume under its default.
  saved = dataclasses.asdict(cfg)
  del saved['relu_dropout_rate']
  assert ckpt.config_differences(saved, cfg) == []
  assert ckpt.config_differences(saved, cfg.replace(relu_dropout_rate=0.1)) == [
      'relu_dropout_rate: 0.0 -> 0.1']


def _corrupt(step_dir):
  for path in glob.glob(os.path.join(step_dir, 'params', '**', '*'),
                        recursive=True):
    if os.path.isfile(path) and os.path.getsize(path) > 0:
      with open(path, 'r+b') as f:
        f.truncate(os.path.getsize(path) // 2)


def test_a_damaged_checkpoint_names_itself_and_the_fallback(tmp_path, cfg):
  _train_in(tmp_path, cfg.replace(train_steps=20))
  _corrupt(tmp_path / 'checkpoints' / '20')
  with pytest.raises(ckpt.CheckpointError) as error:
    _train_in(tmp_path, cfg.replace(train_steps=30))
  message = str(error.value)
  assert os.path.join('checkpoints', '20') in message
  assert 'truncated or corrupted' in message
  assert 'to use step 10' in message


def test_a_checkpoint_of_other_shapes_is_refused(tmp_path, cfg):
  _train_in(tmp_path, cfg.replace(train_steps=10))
  checkpoints = ckpt.Checkpoints(str(tmp_path / 'checkpoints'))
  wider = create_train_state(cfg.replace(d_ff=96), jax.random.key(0))
  with pytest.raises(ckpt.CheckpointError, match=r'saved \(32, 64\), model '
                     r'\(32, 96\)'):
    checkpoints.restore(10, wider)
  checkpoints.close()


def test_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(
    tmp_path, cfg):
  cfg = cfg.replace(train_steps=10, checkpoint_every=1, log_every=5)
  good, _ = _train_in(tmp_path, cfg)
  # A run that goes wrong: one weight becomes NaN, so every later loss is NaN.
  parallel = DataParallel(cfg)
  poisoned = good.replace(params=jax.tree.map(
      lambda x: x.at[(0,) * x.ndim].set(jnp.nan), good.params))
  with ckpt.Checkpoints(str(tmp_path / 'checkpoints'),
                        writer=True) as checkpoints:
    with pytest.raises(loop.NonFinite) as error:
      loop.train(cfg.replace(train_steps=30), poisoned, jax.random.key(0),
                 functools.partial(copy_task.train_batch, cfg),
                 parallel=parallel, checkpoints=checkpoints)
    assert error.value.step == 11
    assert 'the loss became nan at step 11' in str(error.value)
    assert 'step 10, is the last good one' in str(error.value)
    assert checkpoints.latest_step() == 10
    state, _ = checkpoints.restore(10, good)
  assert all(np.all(np.isfinite(x)) for x in _leaves(state.params))


class _DivergingUpdates:
  """A DataParallel whose every update makes the parameters NaN.

  The loss of step k is computed before update k, so every logged loss stays
  finite: only the state itself shows the damage.
  """

  def __init__(self, parallel: DataParallel):
    self._parallel = parallel

  def __getattr__(self, name):
    return getattr(self._parallel, name)

  def train_step(self, state, batch, rng):
    state, metrics = self._parallel.train_step(state, batch, rng)
    return state.replace(params=jax.tree.map(lambda x: x * jnp.nan,
                                             state.params)), metrics


def test_a_state_that_becomes_non_finite_is_never_saved(tmp_path, cfg):
  cfg = cfg.replace(train_steps=3, checkpoint_every=1)
  parallel = _DivergingUpdates(DataParallel(cfg))
  with ckpt.Checkpoints(str(tmp_path / 'checkpoints'),
                        writer=True) as checkpoints:
    with pytest.raises(loop.NonFinite, match='parameters or optimizer state '
                       'became non-finite at step 1.*no checkpoint was '
                       'written'):
      loop.train(cfg, create_train_state(cfg, jax.random.key(0)),
                 jax.random.key(1), functools.partial(copy_task.train_batch,
                                                      cfg),
                 parallel=parallel, checkpoints=checkpoints)
    assert checkpoints.steps() == []


def test_a_run_that_ends_non_finite_fails_even_without_checkpoints(cfg):
  cfg = cfg.replace(train_steps=1)
  with pytest.raises(loop.NonFinite, match='became non-finite at step 1'):
    loop.train(cfg, create_train_state(cfg, jax.random.key(0)),
               jax.random.key(1), functools.partial(copy_task.train_batch, cfg),
               parallel=_DivergingUpdates(DataParallel(cfg)))


def _flip_one_bit(step_dir):
  """Flips one bit in the middle of the largest params data file."""
  files = [p for p in glob.glob(os.path.join(step_dir, 'params', '**', '*'),
                                recursive=True) if os.path.isfile(p)]
  largest = max(files, key=os.path.getsize)
  with open(largest, 'r+b') as f:
    f.seek(os.path.getsize(largest) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.versions
def test_a_flipped_bit_is_refused_naming_the_step_and_the_fallback(tmp_path,
                                                                   cfg):
  _train_in(tmp_path, cfg.replace(train_steps=20))
  _flip_one_bit(tmp_path / 'checkpoints' / '20')
  with pytest.raises(ckpt.CheckpointError) as error:
    _train_in(tmp_path, cfg.replace(train_steps=30))
  # The store's layout varies from write to write, so the bit lands in
  # compressed bytes (the decoder fails) or in raw ones (the checksums
  # catch it); either way one message names the step and the way on.
  message = str(error.value)
  assert os.path.join('checkpoints', '20') in message
  assert ('it is truncated or corrupted' in message or
          'differ from what was saved' in message), message
  assert 'move' in message and 'to use step 10' in message
  with pytest.raises(ckpt.CheckpointError, match='could not be read'):
    ckpt.load_params(str(tmp_path / 'checkpoints'), cfg)


def test_arrays_that_read_well_but_changed_on_disk_are_refused(tmp_path, cfg):
  # Step 10's parameter files in step 20's place read without an error; only
  # the checksums saved with step 20 show that they are not what it saved.
  _train_in(tmp_path, cfg.replace(train_steps=20))
  saved = tmp_path / 'checkpoints'
  shutil.rmtree(saved / '20' / 'params')
  shutil.copytree(saved / '10' / 'params', saved / '20' / 'params')
  with pytest.raises(ckpt.CheckpointError) as error:
    _train_in(tmp_path, cfg.replace(train_steps=30))
  message = str(error.value)
  assert os.path.join('checkpoints', '20') in message
  assert 'differ from what was saved' in message and 'to use step 10' in message
  with pytest.raises(ckpt.CheckpointError, match='differ from what was saved'):
    ckpt.load_params(str(saved), cfg)


def test_averaging(tmp_path, cfg):
  checkpoints = ckpt.Checkpoints(str(tmp_path / 'checkpoints'), keep=5,
                                 writer=True)
  state = create_train_state(cfg, jax.random.key(0))
  like = state.params
  shifted = jax.tree.map(lambda x: x + 2.0, state.params)
  checkpoints.save(1, state, jax.random.key(1), cfg)
  checkpoints.save(2, state, jax.random.key(1), cfg)
  checkpoints.save(3, state.replace(params=shifted), jax.random.key(1), cfg)
  checkpoints.wait()
  identical, steps = ckpt.average_params(checkpoints, 1, like)
  assert steps == [3]
  for a, b in zip(_leaves(identical), _leaves(shifted)):
    np.testing.assert_array_equal(a, b)
  # Averaging identical checkpoints is the identity ...
  checkpoints.save(4, state.replace(params=shifted), jax.random.key(1), cfg)
  checkpoints.wait()
  same, _ = ckpt.average_params(checkpoints, 2, like)
  for a, b in zip(_leaves(same), _leaves(shifted)):
    np.testing.assert_allclose(a, b, rtol=1e-7)
  # ... and averaging two known states gives their mean.
  mean, steps = ckpt.average_params(checkpoints, 3, like)
  assert steps == [2, 3, 4]
  for a, b in zip(_leaves(mean), _leaves(state.params)):
    np.testing.assert_allclose(a, b + 4.0 / 3.0, rtol=1e-6, atol=1e-6)
  with pytest.raises(ckpt.CheckpointError, match='average_last=9'):
    ckpt.average_params(checkpoints, 9, like)
  checkpoints.close()


@pytest.mark.versions
def test_averaged_params_save_and_load_for_inference(tmp_path, cfg):
  state, _ = _train_in(tmp_path, cfg.replace(train_steps=30))
  with ckpt.Checkpoints(str(tmp_path / 'checkpoints')) as checkpoints:
    mean, steps = ckpt.average_params(checkpoints, 3, state.params)
  assert steps == [10, 20, 30]
  with ckpt.Checkpoints(str(tmp_path / AVERAGED), keep=1,
                        writer=True) as out:
    out.save_params(30, mean, cfg, {'averaged_steps': steps})
    out.wait()
    out.save_params(30, mean, cfg, {'averaged_steps': steps})  # replaced
  averaged = ckpt.load_params(str(tmp_path / AVERAGED), cfg)
  latest = ckpt.load_params(str(tmp_path / 'checkpoints'), cfg)
  for a, b in zip(_leaves(latest), _leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(_leaves(averaged), _leaves(mean)):
    np.testing.assert_array_equal(a, b)
  assert not all(np.array_equal(a, b) for a, b in
                 zip(_leaves(averaged), _leaves(latest)))
  with pytest.raises(ckpt.CheckpointError, match='does not fit'):
    ckpt.load_params(str(tmp_path / AVERAGED),
                     cfg.replace(d_model=16, d_ff=32))
  assert load_run(str(tmp_path)).config == cfg.replace(train_steps=30)


def _start_training(workdir, *flags):
  return subprocess.Popen(
      [sys.executable, os.path.join(ROOT, 'train.py'), '--task=copy',
       f'--workdir={workdir}', '--train_steps=100000', '--eval_every=100000',
       *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      cwd=ROOT)


def _wait_for_checkpoint(workdir, process, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if glob.glob(os.path.join(workdir, 'checkpoints', '[0-9]*')):
      return
    assert process.poll() is None, process.communicate()[1][-2000:]
    time.sleep(0.2)
  raise AssertionError('no checkpoint appeared')


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_exits_cleanly(tmp_path, signum):
  process = _start_training(tmp_path, '--checkpoint_every=50')
  _wait_for_checkpoint(tmp_path, process)
  process.send_signal(signum)
  _, err = process.communicate(timeout=120)
  assert process.returncode == 128 + signum
  assert 'Traceback' not in err
  name = signal.Signals(signum).name
  assert f'interrupted by {name} after step' in err
  step = int(err.split('after step ')[1].split(':')[0])
  checkpoints = ckpt.Checkpoints(str(tmp_path / 'checkpoints'))
  assert checkpoints.latest_step() == step
  assert checkpoints.read_meta(step)['step'] == step
  checkpoints.close()


def test_kill_9_again_and_again_while_writing_then_resume_bitwise(tmp_path):
  # Saving a wider model at every step, the process spends much of its time
  # writing. Kill it (SIGKILL) a few times in one workdir, at least once in
  # the middle of a write; every start resumes from the newest complete
  # step, and the end is bitwise the uninterrupted run's.
  model = ['--d_model=256', '--d_ff=1024', '--copy_length=4',
           '--keep_checkpoints=3', '--dropout_rate=0.1', '--log_every=5']
  workdir, kills, mid_write = tmp_path / 'killed', 0, 0
  rng = np.random.default_rng(0)
  def newest():
    directory = workdir / 'checkpoints'
    return max([int(e) for e in os.listdir(directory) if e.isdigit()]
               if directory.exists() else [], default=0)

  while kills < 3 or not mid_write:
    assert kills < 10, 'no kill landed during a write'
    before = newest()
    process = _start_training(workdir, '--checkpoint_every=1', *model)
    deadline = time.time() + 240
    while newest() <= before:
      assert time.time() < deadline and process.poll() is None
      time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.6))
    process.kill()
    process.communicate()
    kills += 1
    mid_write += any(not e.isdigit()
                     for e in os.listdir(workdir / 'checkpoints'))
  with ckpt.Checkpoints(str(workdir / 'checkpoints')) as checkpoints:
    latest = checkpoints.latest_step()
  end = latest + 3

  def finish(directory):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, 'train.py'), '--task=copy',
         f'--workdir={directory}', f'--train_steps={end}',
         '--eval_every=100000', '--checkpoint_every=1', *model],
        capture_output=True, text=True, cwd=ROOT, timeout=600)

  resumed = finish(workdir)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f'resuming from step {latest} ' in resumed.stdout
  assert not [e for e in os.listdir(workdir / 'checkpoints')
              if not e.isdigit()]
  whole = finish(tmp_path / 'whole')
  assert whole.returncode == 0, whole.stderr[-2000:]
  ends = [load_run(str(directory)).params
          for directory in (workdir, tmp_path / 'whole')]
  for a, b in zip(*map(_leaves, ends)):
    np.testing.assert_array_equal(a, b)


_WRITE_OR_READ = '''
    import sys
    import jax, numpy as np
    from flaxformer_mini import checkpoints as ckpt
    from flaxformer_mini.config import get_config
    from flaxformer_mini.parallel import DataParallel
    from flaxformer_mini.training import create_train_state

    action, directory, expected = sys.argv[1:4]
    cfg = get_config('copy').replace(copy_length=5)
    parallel = DataParallel(cfg)
    state = create_train_state(cfg, jax.random.key(0))
    checkpoints = ckpt.Checkpoints(directory, writer=action == 'write')
    if action == 'write':
      state = state.replace(step=7, params=jax.tree.map(lambda x: x + 0.5,
                                                        state.params))
      placed = parallel.replicate(state)
      checkpoints.save(7, placed, jax.random.key(3),
                       cfg)
      checkpoints.wait()
      np.savez(expected, *[np.asarray(x) for x in
                           jax.tree.leaves(state.params)])
    else:
      restored, meta = checkpoints.restore(7, state, parallel.replicated)
      placed = parallel.replicate(restored)
      leaves = jax.tree.leaves(parallel.local_copy(placed).params)
      reference = np.load(expected)
      for i, leaf in enumerate(leaves):
        np.testing.assert_array_equal(np.asarray(leaf), reference[f'arr_{i}'])
      assert int(restored.step) == 7 and meta['step'] == 7
    checkpoints.close()
    print('ok', jax.device_count())
'''


@pytest.mark.versions
@pytest.mark.parametrize('writer, reader', [(8, 1), (1, 8)])
def test_checkpoints_move_between_device_counts(tmp_path, writer, reader):
  def run(action, devices):
    env = dict(os.environ, JAX_PLATFORMS='cpu',
               XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}')
    return subprocess.run(
        [sys.executable, '-c', textwrap.dedent(_WRITE_OR_READ), action,
         str(tmp_path / 'checkpoints'), str(tmp_path / 'expected.npz')],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
  for action, devices in (('write', writer), ('read', reader)):
    result = run(action, devices)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ['ok', str(devices)]


def _one_second_a_step(monkeypatch) -> dict:
  """A clock for the loop that moves one second with every step it takes
  (batches are made ahead in another thread, so not when they are made)."""
  clock = {'now': 0.0}
  monkeypatch.setattr(loop.time, 'perf_counter', lambda: clock['now'])
  take = loop._OnDevice.take  # pylint: disable=protected-access

  def timed_take(self, batch):
    clock['now'] += 1.0
    take(self, batch)

  monkeypatch.setattr(loop._OnDevice, 'take', timed_take)  # pylint: disable=protected-access
  return clock


@pytest.mark.parametrize('log_every', [5, 100_000])
def test_a_time_budget_stops_before_the_next_check_would_pass_it(
    monkeypatch, cfg, log_every):
  # A clock that moves one second per training step. The budget is checked
  # at every log and at least every BUDGET_CHECK_SECONDS (2 steps here),
  # each check judging the next interval by the last, so 12.5 seconds hold
  # 12 steps however rarely the run logs.
  assert loop.BUDGET_CHECK_SECONDS == 2.0
  _one_second_a_step(monkeypatch)
  batch_at = functools.partial(copy_task.train_batch, cfg)
  budget = cfg.replace(train_steps=10_000, log_every=log_every,
                       max_train_minutes=12.5 / 60)
  state, _ = loop.train(budget, create_train_state(budget,
                                                   jax.random.key(0)),
                        jax.random.key(1), batch_at)
  assert int(state.step) == 12


@pytest.mark.parametrize('changes, says', [
    ({'checkpoint_every': 100},
     'reaches about step 12 at this speed, before the first checkpoint '
     '(--checkpoint_every=100)'),
    ({'checkpoint_every': 5, 'average_last': 4, 'keep_checkpoints': 4},
     'reaches about step 12 at this speed, before 4 checkpoints to average '
     '(--average_last, every 5 steps)'),
    ({'checkpoint_every': 5, 'cooldown_steps': 2000},
     'reaches about step 12 at this speed, before the learning rate has '
     'cooled down to 0 (--cooldown_steps=2000 ends at --train_steps=10000); '
     'lower --train_steps to fit')])
def test_a_budget_too_short_for_the_saves_says_so_at_the_first_log(
    monkeypatch, capsys, cfg, changes, says):
  # One second per step: a 12-second budget.
  _one_second_a_step(monkeypatch)
  batch_at = functools.partial(copy_task.train_batch, cfg)
  budget = cfg.replace(train_steps=10_000, max_train_minutes=0.2, **changes)
  loop.train(budget, create_train_state(budget, jax.random.key(0)),
             jax.random.key(1), batch_at)
  assert f'--max_train_minutes=0.2 {says}' in capsys.readouterr().out


def test_a_time_budget_stops_with_a_checkpoint(tmp_path, cfg):
  state, _ = _train_in(tmp_path, cfg.replace(train_steps=10_000,
                                             max_train_minutes=1e-6))
  # At the first check: the first log, or 2 s into a first step that compiles.
  assert 1 <= int(state.step) <= cfg.log_every
  checkpoints = ckpt.Checkpoints(str(tmp_path / 'checkpoints'))
  assert checkpoints.latest_step() == int(state.step)
  checkpoints.close()
