"""train.py's command line: bad input fails fast, in one line; the copy run works."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from flaxformer_mini import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(*args, cwd=ROOT, env=None):
  return subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), *args],
                        capture_output=True, text=True, cwd=cwd, timeout=600,
                        env=env)


@pytest.mark.parametrize('args, expected', [
    (['--task=sing'], ["--task", "'copy'"]),
    (['--task=copy', '--config=huge'], ['--config', 'toy', 'big']),
    (['--task=copy', '--wings=2'], ['--wings', 'config field']),
    (['--task=copy', '--num_heads=3'], ['--num_heads', '[1, 2, 4, 8, 16, 32]']),
    (['--task=copy', '--dropout_rate=1.5'], ['--dropout_rate', '[0, 1)']),
    (['--task=copy', '--d_ff=0'], ['--d_ff', 'positive']),
    (['--task=copy', '--d_model=-8'], ['--d_model', 'positive']),
    (['--task=copy', '--pre_norm=perhaps'], ['--pre_norm', 'true, false']),
    (['--task=copy', '--d_model=abc'], ['--d_model=abc', 'type int']),
])
def test_bad_input_gives_a_one_line_error_naming_the_flag(args, expected):
  result = _train(*args)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  for text in expected:
    assert text in lines[0]
  assert 'Traceback' not in result.stderr


def test_help_lists_every_config_field_with_its_default_and_choices():
  result = _train('--help')
  assert result.returncode == 0
  for text in ('--d_model', 'default 512', 'toy=8', '--pre_norm',
               '--label_smoothing', '--warmup_steps', '--copy_length',
               'one of float32, bfloat16'):
    assert text in result.stdout


def test_override_parses_strings_by_field_type():
  sys.path.insert(0, ROOT)
  import train  # pylint: disable=g-import-not-at-top
  from flaxformer_mini.config import get_config  # pylint: disable=g-import-not-at-top
  cfg = train.override(get_config('copy'), {
      'd_model': '32', 'pre_norm': 'true', 'dropout_rate': '0.2',
      'cpu_kernels': 'yes'})
  assert (cfg.d_model, cfg.pre_norm, cfg.dropout_rate, cfg.cpu_kernels) == (
      32, True, 0.2, True)


@pytest.mark.slow
@pytest.mark.versions
def test_copy_task_end_to_end_reaches_exact_match_one(tmp_path):
  """The default `python train.py --task=copy`, as the README runs it.

  With translation's extra dependencies made unimportable: the copy task
  runs on what `pip install -e .` installs (and where only an accelerator's
  JAX stack is, a GPU image without TFDS).
  """
  shadow = tmp_path / 'shadow'
  shadow.mkdir()
  for name in cli.TRANSLATION_MODULES:
    (shadow / f'{name}.py').write_text(
        f'raise ImportError("the copy task must not need {name}")')
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
      [str(shadow), os.environ.get('PYTHONPATH', '')])}
  result = _train('--task=copy', cwd=tmp_path, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  path = tmp_path / 'runs' / 'copy' / 'results.json'
  assert str(path.resolve()) in result.stdout
  results = json.loads(path.read_text())
  assert results['task'] == 'copy'
  assert results['exact_match'] == 1.0
  assert results['eval_sequences'] >= 1000
  assert results['config']['d_model'] == 32
  assert results['steps'] <= results['config']['train_steps']
  assert results['final_loss'] < 0.1
  assert results['wall_seconds'] > 0
  shown = [l.split(': ', 1) for l in result.stdout.splitlines()
           if l.startswith(('source: ', 'output: '))]
  assert len(shown) == 8  # four sources, each with its copy and no eos
  assert all(src == out for (_, src), (_, out) in zip(shown[::2], shown[1::2]))
  workdir = path.parent
  records = [json.loads(l) for l in (workdir / 'metrics.jsonl').open()]
  assert {r['kind'] for r in records} == {'train', 'eval'}
  assert records[-1] == {'kind': 'eval', 'step': results['steps'],
                         'exact_match': 1.0}
  # It stops after five perfect evaluations in a row, not on one.
  evals = [r['exact_match'] for r in records if r['kind'] == 'eval']
  assert evals[-5:] == [1.0] * 5
  assert (workdir / 'curves.png').read_bytes()[:4] == b'\x89PNG'
  assert list((workdir / 'tensorboard').glob('events.out.tfevents.*'))


def _python_blocks(path: str) -> list[str]:
  with open(os.path.join(ROOT, path), encoding='utf-8') as f:
    return re.findall(r'```python\n(.*?)```', f.read(), re.S)


# What the README's export block may not import (it says only jax, numpy and
# sentencepiece load the artifact).
_REFUSE_THE_PACKAGE = textwrap.dedent('''
    import importlib.abc, sys
    class Refuse(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('flaxformer_mini', 'flax'):
          raise ImportError(f'{name} may not be imported here')
    sys.meta_path.insert(0, Refuse())
''')


def _python(code: str, cwd, **env) -> str:
  result = subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, cwd=cwd, timeout=600,
                          env=dict(os.environ, **env))
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


@pytest.mark.slow
def test_the_readmes_code_runs_as_written(tiny_run, monkeypatch, tmp_path):
  """The README's Python blocks (a step and the logits of the toy; translating
  with a trained workdir, the tiny run's) and docs/library.md's, which go on
  from the first block's names: decoding and rescoring in one's own jit,
  sampling, a search over a bigram table, the mesh on 8 devices, the exported
  search loaded where flaxformer_mini and flax cannot be imported, and the
  run served by CTranslate2 there too."""
  first, translating, serving = _python_blocks('README.md')
  rescoring, bigram, mesh, exported = _python_blocks('docs/library.md')
  names = {}
  exec(first, names)  # pylint: disable=exec-used
  assert names['logits'].shape == (2, 4, 11)
  assert set(names['metrics']) >= {'loss_sum', 'ntokens', 'correct'}
  exec(rescoring, names)  # pylint: disable=exec-used
  assert names['drawn'].shape[:2] == (2, 3)
  assert names['by_temperature'].shape[:3] == (3, 2, 1)
  exec(bigram, names)  # pylint: disable=exec-used
  sources = re.search(r'^sources = .*?\]\]\)$', rescoring, re.S | re.M)[0]
  assert _python(
      '\n'.join([first, sources, mesh, 'print(jax.device_count())']), ROOT,
      XLA_FLAGS='--xla_force_host_platform_device_count=8',
      JAX_PLATFORMS='cpu').endswith('8\n')
  monkeypatch.chdir(tiny_run[0].parent)
  exec(translating.replace("'runs/translate'", repr(tiny_run[0].name)), {})  # pylint: disable=exec-used
  subprocess.run([sys.executable, '-m', 'flaxformer_mini.export',
                  f'--workdir={tiny_run[0]}', f'--out={tmp_path / "exported"}'],
                 check=True, capture_output=True, cwd=ROOT, timeout=600)
  printed = _python(_REFUSE_THE_PACKAGE + exported, tmp_path, PYTHONPATH='')
  assert len(printed.splitlines()) == 1
  subprocess.run([sys.executable, '-m', 'flaxformer_mini.to_ctranslate2',
                  f'--workdir={tiny_run[0]}', f'--out={tmp_path / "D"}'],
                 check=True, capture_output=True, cwd=ROOT, timeout=600)
  printed = _python(
      _REFUSE_THE_PACKAGE + "lines = ['A dog runs.', 'Two men sit.']\n"
      + textwrap.dedent(serving) + 'print(len(translations))', tmp_path,
      PYTHONPATH='')
  assert printed == '2\n'


_DEVICES_SCRIPT = textwrap.dedent('''
    import os
    import jax
    from flaxformer_mini import translate
    translate._one_device_per_core()
    print(jax.local_device_count(), len(os.sched_getaffinity(0)))
''')


@pytest.mark.parametrize('setting, expected', [
    ({}, 'cores'),
    ({'XLA_FLAGS': '--xla_force_host_platform_device_count=3'}, 3),
    ({'JAX_NUM_CPU_DEVICES': '5'}, 5),
])
def test_the_translate_command_makes_a_cpu_device_per_core_unless_told(
    setting, expected):
  """On a CPU the translate command searches on one device per core, each
  its own share of a batch; a device count already set is kept."""
  env = {key: value for key, value in os.environ.items()
         if key not in ('XLA_FLAGS', 'JAX_NUM_CPU_DEVICES')}
  result = subprocess.run([sys.executable, '-c', _DEVICES_SCRIPT],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**env, 'JAX_PLATFORMS': 'cpu', **setting},
                          timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  devices, cores = map(int, result.stdout.split())
  assert devices == (cores if expected == 'cores' else expected)


def test_checking_translation_extras_imports_none_of_them():
  """The translate command checks its extras are installed without importing
  TFDS, which it never uses (half a second of every call)."""
  code = ('import sys; from flaxformer_mini import cli; '
          'assert cli.missing_translation_extras() is None; '
          'print(sorted(set(cli.TRANSLATION_MODULES) & set(sys.modules)))')
  result = subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ['[]']
