"""Data parallelism on 8 simulated CPU devices and on 2 processes.

Each test runs its JAX program in a subprocess: the device count is fixed when
JAX starts, and the suite's own process keeps one device.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flaxformer_mini.data import tokenized

# 8 simulated devices and 2 processes each need a process of their own.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code_or_args, devices=8, timeout=600, extra_env=None, cwd=ROOT):
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}',
             **(extra_env or {}))
  args = (['-c', textwrap.dedent(code_or_args)]
          if isinstance(code_or_args, str) else code_or_args)
  return subprocess.run([sys.executable, *args], capture_output=True,
                        text=True, cwd=cwd, env=env, timeout=timeout)


def _last_json(result):
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


_EQUIVALENCE = '''
    import functools, json, re
    import jax, numpy as np
    from flaxformer_mini.config import get_config
    from flaxformer_mini.data import copy_task
    from flaxformer_mini.parallel import DataParallel
    from flaxformer_mini.training import create_train_state, train_step

    assert jax.device_count() == 8
    cfg = get_config('copy').replace(batch_size=16, dropout_rate=0.0)
    rng = jax.random.key(1)

    def one_device(cfg):
      state = create_train_state(cfg, jax.random.key(0))
      step = jax.jit(functools.partial(train_step, config=cfg))
      for i in range(3):
        state, metrics = step(state, copy_task.train_batch(cfg, i), rng)
      return state, jax.device_get(metrics)

    def eight_devices(cfg):
      dp = DataParallel(cfg)
      placed = dp.replicate(create_train_state(cfg, jax.random.key(0)))
      for i in range(3):
        placed, metrics = dp.train_step(
            placed, dp.put_batch(copy_task.train_batch(cfg, i)), rng)
      return dp.local_copy(placed), dp.to_host(metrics)

    def gap(a, b):
      return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                 for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    one, one_metrics = one_device(cfg)
    state, metrics = eight_devices(cfg)
    report = {
        'param_gap': gap(state.params, one.params),
        'metrics': {k: [float(metrics[k]), float(one_metrics[k])]
                    for k in ('loss_sum', 'ntokens', 'correct',
                              'learning_rate')},
        'step': int(state.step)}
    # docs/parallel.md's pmap version of the same three steps.
    with open('docs/parallel.md') as f:
      snippet = re.search(r'```python\\n(.*?)```', f.read(), re.S).group(1)
    namespace = {}
    exec(snippet, namespace)
    report['pmap_gap'] = gap(namespace['params'], state.params)
    with_dropout = cfg.replace(dropout_rate=0.1)
    first, _ = eight_devices(with_dropout)
    again, _ = eight_devices(with_dropout)
    report['dropout'] = {
        'repeat_gap': gap(first.params, again.params),
        'effect': gap(first.params, state.params)}
    try:
      DataParallel(cfg).put_batch(copy_task.train_batch(
          cfg.replace(batch_size=12), 0))
      report['indivisible'] = 'no error'
    except ValueError as e:
      report['indivisible'] = str(e)
    print(json.dumps(report))
'''


@pytest.fixture(scope='module')
def equivalence_report():
  return _last_json(_run(_EQUIVALENCE))


@pytest.mark.versions
def test_eight_devices_take_the_same_steps_as_one(equivalence_report):
  report = equivalence_report
  assert report['step'] == 3
  assert report['param_gap'] < 1e-6
  for name, (eight, one) in report['metrics'].items():
    np.testing.assert_allclose(eight, one, rtol=1e-6, err_msg=name)


@pytest.mark.versions
def test_the_pmap_example_of_the_docs_takes_the_same_steps(equivalence_report):
  assert equivalence_report['pmap_gap'] < 1e-6


@pytest.mark.versions
def test_dropout_on_eight_devices_is_deterministic_for_a_seed(
    equivalence_report):
  report = equivalence_report['dropout']
  assert report['repeat_gap'] == 0.0
  assert report['effect'] > 0.0  # dropout did act


@pytest.mark.versions
def test_a_batch_that_does_not_divide_is_refused(equivalence_report):
  assert 'does not divide over 8 devices' in equivalence_report['indivisible']


def test_train_py_refuses_an_indivisible_batch_in_one_line():
  result = _run([os.path.join(ROOT, 'train.py'), '--task=copy',
                 '--batch_size=60'])
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and '--batch_size=60' in lines[0]
  assert 'multiple of 8' in lines[0]


def test_train_py_on_eight_devices_takes_the_one_device_steps(tmp_path):
  # The whole command (batches, the mapped step, logging, the final
  # evaluation) on 8 devices: the same losses and exact match as on 1. That
  # the copy task then learns to exact match 1.0 is test_cli's.
  results = {}
  for devices in (8, 1):
    workdir = tmp_path / str(devices)
    result = _run([os.path.join(ROOT, 'train.py'), '--task=copy',
                   f'--workdir={workdir}', '--train_steps=60',
                   '--log_every=10', '--eval_every=30'], devices=devices)
    assert result.returncode == 0, result.stderr[-3000:]
    results[devices] = json.loads((workdir / 'results.json').read_text())
  assert results[8]['devices'] == 8 and results[1]['devices'] == 1
  np.testing.assert_allclose([h['loss'] for h in results[8]['history']],
                             [h['loss'] for h in results[1]['history']],
                             rtol=1e-5)
  assert results[8]['exact_match'] == results[1]['exact_match']


_MULTIHOST = '''
    import json, sys
    import jax, numpy as np
    process_id, port, out, data = (int(sys.argv[1]), sys.argv[2], sys.argv[3],
                                   sys.argv[4])
    if process_id >= 0:
      jax.distributed.initialize(f'localhost:{port}', num_processes=2,
                                 process_id=process_id)
    from flaxformer_mini import loop
    from flaxformer_mini.config import get_config
    from flaxformer_mini.data import batching, copy_task, tokenized
    from flaxformer_mini.training import create_train_state

    cfg = get_config('copy').replace(batch_size=16, train_steps=6,
                                     log_every=1, dropout_rate=0.0)
    shard = (jax.process_index(), jax.process_count())
    read = []
    if data == 'copy':
      batch_at = lambda step: copy_task.train_batch(cfg, step, shard)
    else:  # token batches of a tokenized split, as translation reads them
      class Recorded:
        split = tokenized.TokenizedSplit(data, 'train')
        lengths = split.lengths

        def pair(self, index):
          read.append(int(index))
          return self.split.pair(index)

      batches = batching.TokenBatches(Recorded(), cfg, 256, 2)
      batch_at = lambda step: batches.batch_at(step, shard)
    state, history = loop.train(
        cfg, create_train_state(cfg, jax.random.key(0)), jax.random.key(1),
        batch_at)
    leaves = jax.tree.leaves(state.params)
    np.savez(out, *[np.asarray(x) for x in leaves])
    print(json.dumps({'devices': jax.device_count(),
                      'processes': jax.process_count(),
                      'losses': [h['loss'] for h in history],
                      'read': sorted(read)}))
'''


def _free_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


@pytest.mark.parametrize('data', [
    pytest.param('copy', marks=pytest.mark.versions), 'token batches'])
def test_two_processes_train_in_lockstep_like_one(tmp_path, data):
  """Each process reads only its own rows (token batches: disjoint pairs
  that together are the one process's), and the two train as one."""
  if data != 'copy':
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 20, (200, 2))
    tokenized.write_split(
        str(tmp_path / 'tokens'), 'train',
        [([rng.integers(3, 11, a) for a, _ in lengths],
          [rng.integers(3, 11, b) for _, b in lengths])], 11)
    data = str(tmp_path / 'tokens')
  port = str(_free_port())
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS='--xla_force_host_platform_device_count=1')
  script = textwrap.dedent(_MULTIHOST)
  workers = [
      subprocess.Popen([sys.executable, '-c', script, str(i), port,
                        str(tmp_path / f'process{i}.npz'), data],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, cwd=ROOT, env=env) for i in range(2)]
  outputs = [w.communicate(timeout=600) for w in workers]
  for worker, (_, err) in zip(workers, outputs):
    assert worker.returncode == 0, err[-3000:]
  reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
  single = _last_json(_run(
      ['-c', textwrap.dedent(_MULTIHOST), '-1', '0',
       str(tmp_path / 'single.npz'), data], devices=1))
  assert [r['processes'] for r in reports] == [2, 2]
  assert [r['devices'] for r in reports] == [2, 2]
  assert single['processes'] == 1
  if data != 'copy':
    first, second = (set(r['read']) for r in reports)
    assert first and second and not first & second
    assert sorted(first | second) == single['read']
  # Lockstep: both processes log the same global losses, and so does one.
  np.testing.assert_allclose(reports[0]['losses'], reports[1]['losses'])
  np.testing.assert_allclose(reports[0]['losses'], single['losses'],
                             rtol=1e-5)
  params = [np.load(tmp_path / name) for name in
            ('process0.npz', 'process1.npz', 'single.npz')]
  for key in params[2].files:
    np.testing.assert_array_equal(params[0][key], params[1][key])
    np.testing.assert_allclose(params[0][key], params[2][key], atol=1e-6)
