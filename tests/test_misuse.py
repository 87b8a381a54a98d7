"""Misuse: train.py, workdirs, data and the translate command used carelessly.

Each test names the cases of the reliability review it covers (its ids in
brackets). Command-line cases run in a subprocess, as a user runs them, and
assert the one line that names the problem, that no traceback is printed,
and what happens to the files.
"""

import contextlib
import gzip
import json
import os
import re
import signal
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import (MULTI30K, ROOT, multi30k_lines,
                      tiny_translation_config, tiny_translation_flags)
from flaxformer_mini import checkpoints, disk, loop
from flaxformer_mini.config import get_config
from flaxformer_mini.data import DataError, parallel_text
from flaxformer_mini.data import prepared as prepared_lib
from flaxformer_mini.data import tokenized
from flaxformer_mini.data import tokenizer as spm_lib
from flaxformer_mini.tasks import train_copy, train_translation
from flaxformer_mini.training import init_params
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.workdir import Workdir, WorkdirError

# Every case runs a command or a run, as a user meets it: none is quick.
pytestmark = pytest.mark.slow
needs_multi30k = pytest.mark.skipif(
    not os.path.isdir(MULTI30K), reason=f'Multi30k is not at {MULTI30K}')


def _run(*args, env=None, stdin=None, timeout=300):
  return subprocess.run([sys.executable, *args], capture_output=True,
                        cwd=ROOT, env={**os.environ, **(env or {})},
                        input=stdin, timeout=timeout)


def _train(*args, **kwargs):
  return _run(os.path.join(ROOT, 'train.py'), *args, **kwargs)


def _translate(*args, **kwargs):
  return _run('-m', 'flaxformer_mini.translate', *args, **kwargs)


def _one_line_error(result, code: int, *expected: str) -> str:
  """The single line of stderr, checked for the exit code and its words."""
  err = result.stderr.decode()
  assert result.returncode == code, err[-3000:]
  assert 'Traceback' not in err, err[-3000:]
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1, err
  for text in expected:
    assert text in lines[0], lines[0]
  return lines[0]


def _last_line_error(result, code: int, *expected: str) -> str:
  """The last line of stderr, after the data preparation's progress."""
  err = result.stderr.decode()
  assert result.returncode == code, err[-3000:]
  assert 'Traceback' not in err, err[-3000:]
  last = err.strip().splitlines()[-1]
  for text in expected:
    assert text in last, last
  return last


def _toy_copy_run(workdir, **changes) -> dict:
  config = get_config('toy').replace(**{
      'train_steps': 10, 'log_every': 5, 'checkpoint_every': 5,
      'eval_every': 100_000, **changes})
  return train_copy.run(config, str(workdir))


@pytest.fixture(scope='module')
def toy_workdir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('toy_copy')
  _toy_copy_run(workdir)
  return workdir


@pytest.mark.parametrize('args, code, expected', [
    # [f21] multi-host flags alone would train as one process.
    (['--num_processes=2', '--process_id=1'], 2,
     ['--num_processes and --process_id without --multihost']),
    # [f23] a negative seed, named before anything is written.
    (['--seed=-1'], 2, ['--seed=-1: must be >= 0']),
    # [f24] a vocabulary with no ordinary tokens for the copy task.
    (['--src_vocab_size=3', '--tgt_vocab_size=3'], 2,
     ['--src_vocab_size=3: the copy task needs ordinary tokens']),
    # [n01] nan and inf pass no check of "positive".
    (['--lr_factor=nan'], 2, ['--lr_factor=nan: must be a positive finite']),
    (['--lr_factor=inf'], 2, ['--lr_factor=inf']),
    # A cooldown longer than the run.
    (['--train_steps=100', '--cooldown_steps=200'], 2,
     ['--cooldown_steps=200: must not exceed train_steps=100']),
    # [f25] --multihost where no cluster can be found.
    (['--multihost'], 1, ['could not join a multi-host run']),
])
def test_bad_train_flags_are_one_line_before_anything_runs(tmp_path, args,
                                                           code, expected):
  workdir = tmp_path / 'run'
  _one_line_error(_train('--task=copy', f'--workdir={workdir}', *args), code,
                  *expected)
  assert not workdir.exists()  # nothing left behind


def _without(module: str, command: str) -> str:
  """A Python -c script that runs `command` as if `module` were not installed."""
  return (f'import runpy, sys; sys.modules[{module!r}] = None; '
          f'sys.argv = sys.argv[1:]; {command}')


def test_translation_without_its_extras_says_how_to_install_them(tmp_path):
  # A learner's `pip install -e .` leaves out what only translation needs.
  train = _run('-c', _without('sentencepiece', "runpy.run_path('train.py', "
                              "run_name='__main__')"), 'train.py',
               '--task=translate', f'--data_dir={tmp_path}',
               f'--workdir={tmp_path / "run"}')
  _one_line_error(train, 1, 'translation needs sentencepiece',
                  "pip install -e '.[translate]'")
  translate = _run('-c', _without('sacrebleu', "runpy.run_module("
                                  "'flaxformer_mini.translate', "
                                  "run_name='__main__')"), 'translate',
                   f'--workdir={tmp_path}', stdin=b'Ein Hund.\n')
  _one_line_error(translate, 2, 'translation needs sacrebleu')


def test_a_multihost_run_without_its_peers_says_what_it_waits_for():
  # [f25b] Each process says what it waits for, and gives up instead of
  # waiting forever without a word.
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  flags = ['--task=copy', f'--coordinator_address=localhost:{port}',
           '--num_processes=2', '--multihost_timeout=3']
  start = time.perf_counter()
  # A process other than the coordinator, with no coordinator: one line.
  peer = _train(*flags, '--process_id=1')
  assert 'waiting up to 3 s for all of them' in peer.stdout.decode()
  _one_line_error(peer, 1, f'no coordinator answered at localhost:{port} '
                  'within 3 s')
  # The coordinator alone: JAX ends it once the others are late, and the
  # line says so (not JAX's fatal error and its C++ stack trace).
  coordinator = _train(*flags, '--process_id=0')
  assert 'joining 2 processes' in coordinator.stdout.decode()
  _one_line_error(coordinator, 1, 'train.py: error: the other processes of '
                  'this multi-host run did not join within '
                  '--multihost_timeout=3 s (DEADLINE_EXCEEDED); start every '
                  'process (the same command, each with its own '
                  '--process_id), or raise --multihost_timeout.')
  assert time.perf_counter() - start < 120


def test_a_time_budget_holds_however_rarely_the_run_logs(tmp_path):
  # [max_minutes_rare_logs] No log, evaluation or checkpoint before the end:
  # the budget still ends the run within seconds of passing it, and saves.
  result = _train('--task=copy', '--num_encoder_layers=1',
                  '--num_decoder_layers=1', f'--workdir={tmp_path}',
                  '--max_train_minutes=0.02', '--train_steps=100000',
                  '--log_every=100000', '--eval_every=100000',
                  '--checkpoint_every=0')
  assert result.returncode == 0, result.stderr.decode()[-2000:]
  assert ('--max_train_minutes=0.02: stopping after step'
          in result.stdout.decode())
  results = json.loads((tmp_path / 'results.json').read_text())
  assert results['steps'] < 100_000
  assert os.listdir(tmp_path / 'checkpoints') == [str(results['steps'])]


def test_a_workdir_that_is_a_file_or_not_writable_is_named(tmp_path,
                                                          monkeypatch):
  # [f22] A file where the workdir should be.
  afile = tmp_path / 'afile'
  afile.write_text('not a folder')
  _one_line_error(_train('--task=copy', f'--workdir={afile}'), 1,
                  'is a file, not a folder')
  # [o02, o02b] A read-only workdir (root ignores permissions, so the check
  # itself is asked): refused before the run opens anything.
  monkeypatch.setattr(os, 'access', lambda path, mode: False)
  with pytest.raises(WorkdirError, match='is not writable.*translate command '
                     'and the tour read it where it is'):
    Workdir(str(tmp_path / 'readonly')).__enter__()


def test_a_second_run_on_a_busy_workdir_is_refused_at_once(tmp_path):
  # [c24, c25] One run owns a workdir; the second is refused in one line
  # naming the process, and the first run's checkpoints and log are intact.
  first = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, 'train.py'), '--task=copy',
       f'--workdir={tmp_path}', '--train_steps=100000', '--eval_every=100000',
       '--checkpoint_every=20'], cwd=ROOT, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 240
    while not (tmp_path / 'checkpoints' / '20').exists():
      assert time.time() < deadline and first.poll() is None
      time.sleep(0.2)
    started = time.perf_counter()
    second = _train('--task=copy', f'--workdir={tmp_path}',
                    '--train_steps=100000')
    line = _one_line_error(second, 1, 'is in use by another run',
                           f'pid {first.pid}')
    assert 'another --workdir' in line
    assert time.perf_counter() - started < 30  # at once, not after a compile
  finally:
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
  assert first.returncode == 128 + signal.SIGTERM, err[-2000:]
  steps = [json.loads(line)['step'] for line in
           (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert steps == sorted(set(steps))  # one run's records, no interleaving


def test_fresh_sets_the_whole_earlier_run_aside(tmp_path):
  # [c23] Nothing of the earlier run is erased or overwritten: checkpoints,
  # metrics, results, curves and TensorBoard events move to one folder.
  first = _toy_copy_run(tmp_path)
  records = (tmp_path / 'metrics.jsonl').read_text()
  events = sorted(os.listdir(tmp_path / 'tensorboard'))
  result = _train('--task=copy', '--config=toy', f'--workdir={tmp_path}',
                  '--fresh', '--train_steps=5', '--log_every=5',
                  '--eval_every=100000')
  assert result.returncode == 0, result.stderr.decode()[-2000:]
  (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith('set-aside-')]
  assert f'--fresh: the earlier run is now in {aside}' in result.stdout.decode()
  assert (aside / 'metrics.jsonl').read_text() == records
  assert json.loads((aside / 'results.json').read_text()) == json.loads(
      json.dumps(first))
  assert (aside / 'curves.png').exists()
  assert sorted(os.listdir(aside / 'tensorboard')) == events
  assert sorted(os.listdir(aside / 'checkpoints')) == ['10', '5']
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['5']
  now = [json.loads(line) for line in
         (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in now] == [5]
  assert len(os.listdir(tmp_path / 'tensorboard')) == 1


def test_the_tour_reads_the_workdirs_own_config(toy_workdir, tmp_path):
  # [g01] --tour on a workdir of another config uses the workdir's config.
  result = _train('--task=copy', '--config=copy', '--tour',
                  f'--workdir={toy_workdir}')
  out = result.stdout.decode()
  assert result.returncode == 0, result.stderr.decode()[-2000:]
  assert f'the trained model of {toy_workdir}' in out
  assert 'encoder/layer_0/self_attention/query' in out and '(2, 2, 3, 4)' in out
  # [g02] A mistyped workdir is an error, not a tour of random weights.
  _one_line_error(_train('--task=copy', '--tour',
                         f'--workdir={tmp_path / "mistyped"}'), 1,
                  'mistyped: no such folder')
  random = _train('--task=copy', '--config=toy', '--tour')
  assert 'random weights of the toy preset' in random.stdout.decode()


def test_a_signal_during_the_final_evaluation_exits_cleanly(tmp_path,
                                                           monkeypatch):
  # [x: SIGTERM after training] The run's last checkpoint is on disk; the
  # signal ends the final evaluation with the clean message.
  evaluate = train_copy.exact_match

  def terminated_during_the_final_draw(params, config, decode_fn, draw,
                                       parallel):
    if draw == 0:
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(1)  # the handler runs here
    return evaluate(params, config, decode_fn, draw, parallel)

  monkeypatch.setattr(train_copy, 'exact_match', terminated_during_the_final_draw)
  with pytest.raises(loop.Interrupted, match='interrupted by SIGTERM during '
                     'the final evaluation: checkpoint saved at .*10'):
    _toy_copy_run(tmp_path)
  with checkpoints.Checkpoints(str(tmp_path / 'checkpoints')) as saved:
    assert saved.latest_step() == 10


def _copy_with_a_truncated_step(workdir, copy, step):
  """A copy of `workdir` whose checkpoint `step` has its params files cut in half."""
  shutil.copytree(workdir, copy)
  for path, _, files in os.walk(copy / 'checkpoints' / str(step) / 'params'):
    for name in files:
      with open(os.path.join(path, name), 'r+b') as f:
        f.truncate(os.path.getsize(os.path.join(path, name)) // 2)
  return copy


def test_a_damaged_checkpoint_is_one_clean_line(toy_workdir, tmp_path):
  # [dmg_d12] Only the message: no orbax thread tracebacks after it.
  workdir = _copy_with_a_truncated_step(toy_workdir, tmp_path / 'copy', 10)
  result = _train('--task=copy', '--config=toy', f'--workdir={workdir}',
                  '--train_steps=20')
  _one_line_error(result, 1, 'could not be read', 'to use step 5')


# --- Reading a run never harms it --------------------------------------------


def _snapshot(directory) -> dict:
  """{relative path: (size, mtime)} of every file and folder under directory."""
  found = {}
  for path, folders, files in os.walk(directory):
    for name in folders + files:
      full = os.path.join(path, name)
      stat = os.stat(full)
      found[os.path.relpath(full, directory)] = (
          stat.st_size if name in files else None, stat.st_mtime_ns)
  return found


@needs_multi30k
def test_reading_a_run_leaves_a_save_in_flight_alone(tiny_run, tmp_path):
  # [translate_spares_a_live_save] The workdir is held, as by a training run
  # whose save of step 13 is on its way: orbax's temporary folder, complete
  # but for its metadata. The translate command and both tours read the run
  # and change nothing in it, that folder least of all.
  workdir = tmp_path / 'live'
  shutil.copytree(tiny_run[0], workdir)
  in_flight = workdir / 'checkpoints' / '13.orbax-checkpoint-tmp'
  shutil.copytree(workdir / 'checkpoints' / '12', in_flight)
  (in_flight / '_CHECKPOINT_METADATA').unlink()
  with Workdir(str(workdir)):
    before = _snapshot(workdir)
    translated = _translate(f'--workdir={workdir}', '--beam_size=1',
                            stdin=b'Ein Hund.\nZwei Katzen.\n')
    tours = [_run('-m', 'flaxformer_mini.tour', f'--workdir={workdir}'),
             _train('--task=translate', '--tour', f'--workdir={workdir}')]
    assert _snapshot(workdir) == before
  assert translated.returncode == 0, translated.stderr.decode()[-2000:]
  assert translated.stderr == b''
  assert len(translated.stdout.decode().split('\n')) == 3  # 2 lines + end
  for tour in tours:
    assert tour.returncode == 0, tour.stderr.decode()[-2000:]
    assert 'encoder/layer_0/self_attention/query' in tour.stdout.decode()


@needs_multi30k
def test_translating_while_training_saves_every_step_harms_neither(
    tiny_run, data_slice, tmp_path):
  # [translate_during_training] The translate command, again and again, on a
  # run that saves a checkpoint at every step: the run ends bitwise equal to
  # the same run undisturbed, every step it saved reads back, and every
  # translation is whole.
  end = 12 + 24
  flags = [f'--data_dir={data_slice}', *tiny_translation_flags(
      train_steps=end, checkpoint_every=1, log_every=1, eval_every=100_000,
      keep_checkpoints=1000, average_last=0)]
  runs = {}
  for name in ('disturbed', 'undisturbed'):
    runs[name] = tmp_path / name
    shutil.copytree(tiny_run[0], runs[name])
  # The same run, saving only at its end (saving changes no number).
  calm = _train(*flags, '--checkpoint_every=0',
                f'--workdir={runs["undisturbed"]}', timeout=600)
  assert calm.returncode == 0, calm.stderr.decode()[-3000:]

  workdir = runs['disturbed']
  saved = lambda: [int(e) for e in os.listdir(workdir / 'checkpoints')
                   if e.isdigit()]
  training = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, 'train.py'), *flags,
       f'--workdir={workdir}'], cwd=ROOT, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE)
  lines = b'Ein Hund.\nZwei Katzen spielen.\n\nEin Mann.\n'
  during, translations = 0, []
  try:
    deadline = time.time() + 300
    while max(saved()) <= 12:  # the run's own saves have begun
      assert time.time() < deadline and training.poll() is None
      time.sleep(0.05)
    while training.poll() is None:
      translations.append(_translate(f'--workdir={workdir}', '--beam_size=2',
                                     '--params=latest', stdin=lines))
      during += training.poll() is None
  finally:
    if training.poll() is None:
      training.kill()
    _, err = training.communicate(timeout=600)
  assert training.returncode == 0, err.decode()[-3000:]
  assert during >= 1, 'no translation ran while the run was saving'
  for result in translations:
    assert result.returncode == 0 and result.stderr == b'', (
        result.stderr.decode()[-2000:])
    assert len(result.stdout.decode().split('\n')) == 5  # 4 lines + end
  results = {name: json.loads((path / 'results.json').read_text())
             for name, path in runs.items()}
  assert results['disturbed']['steps'] == end
  assert ([r['loss'] for r in results['disturbed']['history']] ==
          [r['loss'] for r in results['undisturbed']['history']])
  config = tiny_translation_config()
  with checkpoints.Checkpoints(str(workdir / 'checkpoints')) as disturbed:
    assert disturbed.steps() == [6, *range(12, end + 1)]
    like = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    for step in disturbed.steps():
      disturbed.restore_params(step, like)  # every saved step reads back
    last = disturbed.restore_params(end, like)
  calm_last = checkpoints.load_params(
      str(runs['undisturbed'] / 'checkpoints'), config)
  for a, b in zip(jax.tree.leaves(last), jax.tree.leaves(calm_last)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- Damaged workdir files ----------------------------------------------------


def _cut_in_half(path) -> None:
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)


@needs_multi30k
def test_a_damaged_results_json_costs_only_the_choice_of_parameters(
    tiny_run, tmp_path):
  # [translate_results_json_damaged] results.json only says which
  # parameters scored better: the command translates with the latest ones
  # and says why.
  workdir = tmp_path / 'run'
  shutil.copytree(tiny_run[0], workdir)
  _cut_in_half(workdir / 'results.json')
  result = _translate(f'--workdir={workdir}', '--beam_size=1',
                      stdin=b'Ein Hund.\nZwei Katzen.\n')
  assert result.returncode == 0, result.stderr.decode()[-2000:]
  (warning,) = result.stderr.decode().splitlines()
  assert 'results.json is damaged' in warning
  assert 'Using the latest parameters' in warning
  assert len(result.stdout.decode().split('\n')) == 3


@needs_multi30k
def test_a_damaged_vocabulary_is_named_by_every_command(tiny_run, data_slice,
                                                        tmp_path):
  # [vocab_file_truncated] spm.model cut in half, as an interrupted copy of
  # a workdir leaves it: translating and resuming each say so in one line.
  workdir = tmp_path / 'run'
  shutil.copytree(tiny_run[0], workdir)
  _cut_in_half(workdir / 'spm.model')
  expected = f'{workdir}/spm.model is damaged'
  _one_line_error(_translate(f'--workdir={workdir}', stdin=b'Ein Hund.\n'), 2,
                  expected)
  _last_line_error(_train(*tiny_translation_flags(train_steps=13),
                          f'--data_dir={data_slice}', f'--workdir={workdir}'),
                   1, expected, '--fresh')


@needs_multi30k
def test_a_damaged_prepared_record_is_named(tiny_run, data_slice, tmp_path):
  # [prepared_json_damaged]
  workdir = tmp_path / 'run'
  shutil.copytree(tiny_run[0], workdir)
  _cut_in_half(workdir / 'prepared.json')
  with Workdir(str(workdir)) as held:
    with pytest.raises(WorkdirError, match=f'{workdir}/prepared.json is '
                       'damaged.*restore it from a copy'):
      prepared_lib.prepare(tiny_translation_config(), held,
                           prepared_lib.Source(str(data_slice)), fresh=False)


@needs_multi30k
def test_the_same_data_at_another_path_is_accepted_with_a_note(
    tiny_run, data_slice, tmp_path, capsys):
  # [resume_after_data_moved] The same bytes elsewhere (moved, or through a
  # link) are the same data: the run goes on, and says so once.
  workdir = tmp_path / 'run'
  shutil.copytree(tiny_run[0], workdir)
  moved = tmp_path / 'moved'
  shutil.copytree(data_slice, moved)
  with Workdir(str(workdir)) as held:
    data = prepared_lib.prepare(tiny_translation_config(), held,
                                prepared_lib.Source(str(moved)), fresh=False)
    assert held.read_json(workdir_lib.PREPARED)['source'] == str(moved)
  assert len(data.train) == 302
  assert (f'the data moved from {os.path.realpath(data_slice)} to {moved} '
          '(the same contents)') in capsys.readouterr().out


def test_a_cut_last_line_of_the_metrics_log_is_dropped_with_a_word(
    toy_workdir, tmp_path, capsys):
  # [metrics_cut_last_line] The log is only appended to, so a crash or a full
  # disk can cut its last line: the resumed run drops it, says so, and goes
  # on. A damaged line before the last is named.
  workdir = tmp_path / 'run'
  shutil.copytree(toy_workdir, workdir)
  metrics = workdir / 'metrics.jsonl'
  with open(metrics, 'r+b') as f:
    f.truncate(os.path.getsize(metrics) - 20)
  results = _toy_copy_run(workdir, train_steps=15)
  assert results['resumed_from'] == 10 and results['steps'] == 15
  assert 'metrics.jsonl: its last line was cut short' in capsys.readouterr().err
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r['step'] for r in records] == [5, 15]
  lines = metrics.read_text().splitlines()
  metrics.write_text('\n'.join([lines[0][:-9], *lines[1:]]) + '\n')
  with pytest.raises(WorkdirError, match='metrics.jsonl: line 1 is damaged'):
    _toy_copy_run(workdir, train_steps=20)


# --- The translate command as a Unix filter -------------------------------------


def _short_sentences(count: int) -> bytes:
  """`count` short Multi30k lines: none is cut to the tiny model's max_len."""
  lines = [line for line in multi30k_lines('train', 'de') if len(line) <= 24]
  return ('\n'.join((lines * (count // len(lines) + 1))[:count]) +
          '\n').encode()


def _unbuffered_off() -> dict:
  """The environment without PYTHONUNBUFFERED, as a user's shell has it (set,
  a write cut short by a closed pipe goes unnoticed)."""
  return {k: v for k, v in os.environ.items() if k != 'PYTHONUNBUFFERED'}


@needs_multi30k
def test_a_closed_pipe_ends_the_command_quietly(tiny_run, tmp_path):
  # [translate_closed_pipe] `translate ... | head -n 1` with more output than
  # a pipe holds: exit 141 (SIGPIPE's), nothing on stderr.
  source = tmp_path / 'in.txt'
  source.write_bytes(_short_sentences(6000))
  with open(source, 'rb') as stdin:
    command = subprocess.Popen(
        [sys.executable, '-m', 'flaxformer_mini.translate',
         f'--workdir={tiny_run[0]}', '--beam_size=1'], stdin=stdin,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
        env=_unbuffered_off())
    first = command.stdout.readline()
    command.stdout.close()  # as head does after its line
    err = command.stderr.read()
    command.wait(timeout=300)
  assert first.endswith(b'\n')
  assert command.returncode == 141, err.decode()[-2000:]
  assert err == b''


def test_a_file_is_written_whole_or_left_as_it_was(tmp_path):
  # Every file a run, its data or its programs keep goes through
  # disk.written_whole: one that fails midway leaves nothing half written.
  path = tmp_path / 'run.json'
  path.write_text('{"old": 1}')
  with pytest.raises(TypeError, match='not JSON serializable'):
    with disk.written_whole(str(path)) as f:
      json.dump({'written': 1, 'then': object()}, f)
  assert path.read_text() == '{"old": 1}'
  assert os.listdir(tmp_path) == ['run.json']
  with disk.written_whole(str(path), 'wb') as f:
    f.write(b'{"new": 2}')
  assert path.read_text() == '{"new": 2}'
  assert os.listdir(tmp_path) == ['run.json']


def test_a_new_folder_appears_whole_with_the_mode_of_any_new_folder(
    tmp_path):
  # disk.new_folder, the export commands' --out: filled beside its place,
  # renamed there; readable by whoever may read a new folder here (a server
  # running as another user), not by its owner only, as a temporary one is.
  path = str(tmp_path / 'model')
  with pytest.raises(ZeroDivisionError):
    with disk.new_folder(path) as folder:
      open(os.path.join(folder, 'half'), 'w').write('written')
      1 / 0  # pylint: disable=pointless-statement
  assert os.listdir(tmp_path) == []
  with disk.new_folder(path) as folder:
    assert not os.path.exists(path)
    open(os.path.join(folder, 'weights'), 'w').write('whole')
  os.mkdir(tmp_path / 'any')
  mode = lambda name: os.stat(tmp_path / name).st_mode & 0o777
  assert mode('model') == mode('any')
  assert sorted(os.listdir(tmp_path)) == ['any', 'model']
  assert os.listdir(path) == ['weights']
  with pytest.raises(disk.FolderExists, match=(
      r'^.*/model exists; name a new folder \(nothing there was changed\)\.$')):
    with disk.new_folder(path):
      pass
  assert os.listdir(path) == ['weights']


def test_a_new_folder_under_a_file_is_refused_before_any_work(tmp_path):
  (tmp_path / 'file').write_text('x')
  for path in (tmp_path / 'file' / 'model', tmp_path / 'file' / 'a' / 'b'):
    with pytest.raises(NotADirectoryError, match=r'Not a directory: .*/file'):
      disk.check_new_folder(str(path))
    with pytest.raises(NotADirectoryError):
      with disk.new_folder(str(path)):
        pass
  disk.check_new_folder(str(tmp_path / 'a' / 'b'))  # made when written
  with pytest.raises(FileNotFoundError):  # --out= with nothing after it
    disk.check_new_folder('')
  assert os.listdir(tmp_path) == ['file']


def test_a_folder_made_at_a_new_folders_place_meanwhile_is_never_replaced(
    tmp_path, monkeypatch):
  # os.rename replaces an empty folder: one made at the place after the
  # check is refused and left as it was made; a file put into the place
  # just before the rename stays there.
  path = str(tmp_path / 'model')
  with pytest.raises(disk.FolderExists, match='model exists; name a new'):
    with disk.new_folder(path) as folder:
      open(os.path.join(folder, 'weights'), 'w').write('ours')
      os.mkdir(path)
  assert os.listdir(path) == []
  assert os.listdir(tmp_path) == ['model']
  os.rmdir(path)
  rename = os.rename

  def rename_after_someone_writes_there(source, target):
    (tmp_path / 'model' / 'theirs').write_text('kept')
    return rename(source, target)

  monkeypatch.setattr(disk.os, 'rename', rename_after_someone_writes_there)
  with pytest.raises(OSError):
    with disk.new_folder(path) as folder:
      open(os.path.join(folder, 'weights'), 'w').write('ours')
  assert os.listdir(path) == ['theirs']
  assert os.listdir(tmp_path) == ['model']


@needs_multi30k
def test_a_full_disk_is_one_line(tiny_run, tmp_path):
  # [translate_disk_full] `> /dev/full`, with more output than Python's
  # buffer and with less (that one fails only as it is flushed).
  for count in (5000, 3):
    with open('/dev/full', 'wb') as full:
      result = subprocess.run(
          [sys.executable, '-m', 'flaxformer_mini.translate',
           f'--workdir={tiny_run[0]}', '--beam_size=1'],
          input=_short_sentences(count), stdout=full, stderr=subprocess.PIPE,
          cwd=ROOT, env=_unbuffered_off(), timeout=300)
    _one_line_error(result, 1, 'the translations could not be written (No '
                    'space left on device)')


@needs_multi30k
def test_ctrl_c_is_one_line_whenever_it_comes(tiny_run, tmp_path):
  # [translate_sigint] SIGINT while JAX loads, while the model loads and while
  # it decodes: one line and exit 130, never a traceback.
  source = tmp_path / 'in.txt'
  source.write_bytes(_short_sentences(20000))
  for delay in (0.5, 1.5, 6.0):
    with open(source, 'rb') as stdin:
      command = subprocess.Popen(
          [sys.executable, '-m', 'flaxformer_mini.translate',
           f'--workdir={tiny_run[0]}'], stdin=stdin,
          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
      time.sleep(delay)
      assert command.poll() is None, 'it ended before the signal'
      command.send_signal(signal.SIGINT)
      _, err = command.communicate(timeout=120)
    assert command.returncode == 130, err.decode()[-2000:]
    assert err.decode().split() == ['translate:', 'interrupted'], err


@needs_multi30k
def test_a_beam_that_cannot_fit_is_refused_before_it_compiles(tiny_run):
  # [translate_beam_huge] 64 sentences x 100,000 beams: refused in one line
  # with the memory it would need, before XLA runs out of it.
  started = time.perf_counter()
  line = _one_line_error(_translate(f'--workdir={tiny_run[0]}',
                                    '--beam_size=100000', stdin=b'Ein Hund.\n'),
                         2, '--beam_size=100000: a search of --batch_size=64 '
                         'sentences with 100000 beams needs about')
  assert 'lower --beam_size or --batch_size' in line
  # A CPU's devices (one per core) share its memory: each has its share.
  cores = len(os.sched_getaffinity(0))
  assert (f'of each of the {cores} CPU devices;' if cores > 1 else
          'of this CPU;') in line
  assert time.perf_counter() - started < 60


@needs_multi30k
def test_input_may_come_from_a_pipe(tiny_run):
  # [translate_input_from_a_pipe] --input=<(zcat ...) names a pipe, not a
  # regular file: it is read like one.
  result = _translate(f'--workdir={tiny_run[0]}', '--beam_size=1',
                      '--input=/dev/stdin', stdin=b'Ein Hund.\nZwei Katzen.\n')
  assert result.returncode == 0, result.stderr.decode()[-2000:]
  assert len(result.stdout.decode().split('\n')) == 3


# --- Data -------------------------------------------------------------------


def _write(path, lines, gz=True, raw=None):
  data = raw if raw is not None else ('\n'.join(lines) + '\n').encode()
  if gz:
    with gzip.open(path, 'wb') as f:
      f.write(data)
  else:
    path.write_bytes(data)


def _random_lines() -> bytes:
  """2,000 lines of random letters: text that gzip cannot shrink much."""
  rng = np.random.default_rng(0)
  return b''.join(bytes(rng.integers(97, 123, 60, dtype=np.uint8)) + b'\n'
                  for _ in range(2000))


def _tiny_corpus(directory, train_de=None):
  directory.mkdir(exist_ok=True)
  for split in ('train', 'val', 'test'):
    _write(directory / f'{split}.en.gz', ['a dog runs', 'two cats'])
    _write(directory / f'{split}.de.gz', ['ein hund', 'zwei katzen'])
  if train_de is not None:
    (directory / 'train.de.gz').write_bytes(train_de)
  return directory


@pytest.mark.parametrize('damage, expected', [
    # [d07] bytes that are not UTF-8, on line 2.
    (lambda: gzip.compress(b'ein hund\nzwei \xff\xfe katzen\n'),
     'train.de.gz: line 2 is not UTF-8 text'),
    # [d08] the gzip cut short (of lines that do not compress away).
    (lambda: (lambda b: b[:len(b) // 2])(gzip.compress(_random_lines())),
     'is truncated or corrupt (EOFError'),
    # [d09] bytes overwritten in the middle of the gzip stream.
    (lambda: (lambda b: b[:len(b) // 2] + b'\x00' * 200 + b[len(b) // 2 + 200:])(
        gzip.compress(_random_lines())), 'is truncated or corrupt'),
])
def test_damaged_data_files_name_the_file_and_line(tmp_path, damage, expected):
  corpus = _tiny_corpus(tmp_path / 'data', damage())
  with pytest.raises(DataError, match=re.escape(expected)):
    parallel_text.local_split_files(str(corpus), ('de', 'en'))
  _one_line_error(_train('--task=translate', f'--data_dir={corpus}',
                         f'--workdir={tmp_path / "run"}'), 1, expected)


@pytest.mark.parametrize('split, lines, expected', [
    # [data_blank_lines] training files of whitespace only.
    ('train', [' ', '\t', '\u3000'] * 100,
     'train.de.gz: no text (every line is empty)'),
    # [data_empty_val] validation files with no lines.
    ('val', [], 'val.de.gz: no text (the file is empty)'),
])
def test_a_split_without_text_is_refused_naming_its_file(tmp_path, split,
                                                         lines, expected):
  corpus = _tiny_corpus(tmp_path / 'data')
  for lang in ('de', 'en'):
    _write(corpus / f'{split}.{lang}.gz', lines,
           raw=b'' if not lines else None)
  _one_line_error(_train('--task=translate', f'--data_dir={corpus}',
                         f'--workdir={tmp_path / "run"}'), 1, expected)


def test_line_ends_and_a_bom_are_read_alike_everywhere(tmp_path):
  # [data_lone_cr, data_bom_crlf] Lines end at '\n' alone, in the count and
  # in the reader alike: a lone '\r' stays inside its line (pair i is line
  # i of both files), '\r\n' is '\n', and a byte-order mark is dropped.
  german = ['ein hund', 'der\rschwarze hund', 'zwei katzen', 'ein mann']
  english = ['a dog', 'the black dog', 'two cats', 'a man']
  corpus = _tiny_corpus(tmp_path / 'data')
  _write(corpus / 'train.de.gz', german, raw=b'\xef\xbb\xbf' + '\r\n'.join(
      german).encode() + b'\r\n')
  _write(corpus / 'train.en.gz', english)
  files = parallel_text.local_split_files(str(corpus), ('de', 'en'))
  splits = parallel_text.load_local(files, ('de', 'en'), str(tmp_path / 'tfds'),
                                    parallel_text.fingerprint(files))
  assert parallel_text.pairs_of(splits['train'], ('de', 'en')) == (
      german, english)


@needs_multi30k
def test_no_training_pair_within_max_len_is_named(data_slice, tmp_path):
  # [data_no_usable_pairs] One line naming --max_len, not a ZeroDivisionError
  # after the model is built.
  flags = tiny_translation_flags(max_len=4, tokens_per_batch=64)
  _last_line_error(_train(*flags, f'--data_dir={data_slice}',
                         f'--workdir={tmp_path / "run"}'), 1,
                  '--max_len=4: none of the', 'raise --max_len')


@pytest.mark.parametrize('dataset, expected', [
    # [dataset_not_a_name] a folder where --data_dir was meant ...
    ('FOLDER', 'is a path; --dataset takes a TFDS name'),
    # ... and another library's name.
    ('huggingface:bentrevett/multi30k', 'TFDS cannot open it'),
])
def test_a_dataset_that_is_not_a_tfds_name_is_one_line(tmp_path, dataset,
                                                        expected):
  if dataset == 'FOLDER':
    dataset = str(_tiny_corpus(tmp_path / 'data'))
  _one_line_error(_train('--task=translate', f'--dataset={dataset}',
                         f'--workdir={tmp_path / "run"}'), 1,
                  f'--dataset={dataset}', expected)


def test_a_tfds_dir_under_a_file_is_named(tmp_path):
  # [tfds_dir_not_a_folder]
  corpus = _tiny_corpus(tmp_path / 'data')
  afile = tmp_path / 'afile'
  afile.write_text('not a folder')
  _one_line_error(_train('--task=translate', f'--data_dir={corpus}',
                         f'--tfds_dir={afile}/tfds',
                         f'--workdir={tmp_path / "run"}'), 1,
                  f'--tfds_dir={afile}/tfds: {afile} is a file, not a folder')


def test_a_translation_run_on_three_devices_is_not_refused_over_batch_size(
    tmp_path):
  # [f19] Translation never uses --batch_size; its batches come from
  # --tokens_per_batch, so 3 devices only meet the data's own problems.
  empty = tmp_path / 'empty'
  empty.mkdir()
  line = _one_line_error(
      _train('--task=translate', f'--data_dir={empty}',
             f'--workdir={tmp_path / "run"}',
             env={'XLA_FLAGS': '--xla_force_host_platform_device_count=3'}),
      1, 'no train.de')
  assert 'batch_size' not in line


def test_too_many_pieces_for_the_text_is_a_data_error(tmp_path):
  # [d14] SentencePiece's own refusal, said in the project's words.
  config = get_config('translate').replace(src_vocab_size=5000,
                                           tgt_vocab_size=5000)
  with pytest.raises(DataError, match=r'--src_vocab_size=5000 is more pieces '
                     r'than SentencePiece can make of this training text \(at '
                     r'most \d+\)'):
    spm_lib.train_tokenizer(['ein hund', 'zwei katzen'] * 50,
                            str(tmp_path / 'spm'), config)


def test_a_tiny_token_budget_is_refused_before_the_data_is_read(tmp_path):
  # [d13]
  _one_line_error(_train('--task=translate', f'--data_dir={tmp_path}',
                         '--tokens_per_batch=40', '--max_len=48',
                         f'--workdir={tmp_path / "run"}'), 2,
                  '--tokens_per_batch=40: holds no batch')


@needs_multi30k
def test_prepared_data_is_keyed_by_what_it_was_prepared_from(data_slice,
                                                             tmp_path):
  # [d20, d21, d22, d23, d23b] Other data, another vocabulary size or
  # another language: refused, naming what changed; with --fresh the earlier
  # run is set aside and everything is prepared again.
  config = tiny_translation_config()
  other = tmp_path / 'other'
  other.mkdir()
  for name in os.listdir(data_slice):
    (other / name).write_bytes((data_slice / name).read_bytes())
  _write(other / 'train.de.gz', ['ein anderer Satz'] * 300 + ['', 'x'])
  workdir = tmp_path / 'run'
  with Workdir(str(workdir)) as held:
    data = prepared_lib.prepare(config, held,
                                prepared_lib.Source(str(data_slice)))
    before = data.tokenizer.decode(data.train.pair(0)[0].tolist())
    first = held.read_json(workdir_lib.PREPARED)
    with pytest.raises(WorkdirError, match="the data's contents"):
      prepared_lib.prepare(config, held, prepared_lib.Source(str(other)))
    with pytest.raises(WorkdirError, match='vocab_size: 300 -> 400'):
      prepared_lib.prepare(config.replace(src_vocab_size=400,
                                      tgt_vocab_size=400), held,
                       prepared_lib.Source(str(data_slice)), False)
    again = prepared_lib.prepare(config, held,
                                 prepared_lib.Source(str(other)), fresh=True)
  # The new data, tokenized again, not stale.
  assert again.tokenizer.decode(again.train.pair(0)[0].tolist()) == (
      'ein anderer Satz') != before
  aside = [p for p in workdir.iterdir() if p.name.startswith('set-aside-')]
  assert len(aside) == 1 and (aside[0] / 'spm.model').exists()
  assert json.loads((aside[0] / 'prepared.json').read_text()) == first


# --- The translate command ---------------------------------------------------


@needs_multi30k
def test_every_input_line_gets_its_own_output_line(tiny_run, tmp_path):
  # [x06, x06b] Only '\n' ends a line, on stdin and from --input alike,
  # whatever other separators (U+2028, form feed, NEL, ...) a line holds.
  workdir, _ = tiny_run
  separators = ['\u2028', '\x0c', '\x85', '\x1d', '\u2029', '\x0b']
  text = ''.join(f'Ein Mann{s}fährt Fahrrad.\nZwei Hunde.\n\nEin Hund {s} '
                 'läuft.\n' for s in separators)
  piped = _translate(f'--workdir={workdir}', '--beam_size=1',
                     stdin=text.encode())
  path = tmp_path / 'input.txt'
  path.write_bytes(text.encode())
  from_file = _translate(f'--workdir={workdir}', '--beam_size=1',
                         f'--input={path}')
  for result in (piped, from_file):
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    outputs = result.stdout.decode().split('\n')[:-1]
    assert len(outputs) == 4 * len(separators)
    assert all(line == '' for line in outputs[2::4])
  assert piped.stdout == from_file.stdout


@needs_multi30k
@pytest.mark.parametrize('flags, expected', [
    (['--beam_size=0'], '--beam_size: 0: must be at least 1'),
    (['--beam_size=-1'], '--beam_size: -1: must be at least 1'),
    (['--batch_size=0'], '--batch_size: 0: must be at least 1'),
    (['--batch_size=-1'], '--batch_size: -1: must be at least 1'),
    (['--alpha=nan'], '--alpha: nan: must be a finite number'),
    (['--input=/no/such/file'], '--input=/no/such/file: no such file'),
    (['--input=/tmp'], '--input=/tmp: a folder, not a file'),
    (['--top_p=0.9'], '--top_p draws translations: add --sample.'),
    (['--sample', '--top_p=0'], '--top_p: 0: must lie in (0, 1]'),
    (['--sample', '--temperature=-1'], '--temperature: -1: must be at least 0'),
    (['--sample', '--num_samples=0'], '--num_samples: 0: must be at least 1'),
    (['--sample', '--refill'],
     '--refill is for the beam search; --sample draws in batches.'),
])
def test_bad_translate_flags_are_refused_before_the_model_loads(
    tiny_run, flags, expected):
  # [x09, x09b, x12, x13, x13b, x14]
  workdir, _ = tiny_run
  _one_line_error(_translate(f'--workdir={workdir}', *flags, stdin=b'x\n'),
                  2, expected)


@needs_multi30k
def test_input_that_is_not_utf8_names_its_line(tiny_run, tmp_path):
  # [x08, x08b]
  workdir, _ = tiny_run
  data = 'Ein Hund.\nZwei'.encode() + b' \xff\xfe\n'
  path = tmp_path / 'latin1.txt'
  path.write_bytes(data)
  _one_line_error(_translate(f'--workdir={workdir}', f'--input={path}'), 2,
                  f'--input={path}: line 2 is not UTF-8 text')
  _one_line_error(_translate(f'--workdir={workdir}', stdin=data), 2,
                  'stdin: line 2 is not UTF-8 text')


@needs_multi30k
def test_translate_on_a_damaged_or_empty_workdir_says_what_to_do(tiny_run,
                                                                 tmp_path):
  # [x10c] spm.model but no checkpoints: one line, and nothing created.
  workdir, _ = tiny_run
  bare = tmp_path / 'bare'
  bare.mkdir()
  (bare / 'spm.model').write_bytes((workdir / 'spm.model').read_bytes())
  _one_line_error(_translate(f'--workdir={bare}', stdin=b'x\n'), 2,
                  'holds no checkpoints')
  assert sorted(os.listdir(bare)) == ['spm.model']
  # [x17] A damaged latest checkpoint: how to use the earlier one, and no
  # advice meant for training (the command has no --fresh).
  damaged = _copy_with_a_truncated_step(workdir, tmp_path / 'damaged', 12)
  line = _one_line_error(_translate(f'--workdir={damaged}', '--params=latest',
                                    stdin=b'x\n'), 2, 'to use step 6')
  assert '--fresh' not in line


# The third review (reliability-3.md): the input pipeline, gradient
# accumulation, multi-host runs and the downloader. Its case names in
# brackets.


def test_train_steps_at_or_below_the_checkpoint_say_so_and_write_nothing(
    toy_workdir, tmp_path):
  # [train_steps_below_checkpoint] The run at toy_workdir finished its 10
  # steps: asking for 5, or again for 10, trains nothing and rewrites nothing.
  workdir = tmp_path / 'run'
  shutil.copytree(toy_workdir, workdir)
  before = {name: (workdir / name).read_bytes()
            for name in ('results.json', 'metrics.jsonl')}
  for steps in (5, 10):
    result = _train('--task=copy', '--config=toy', f'--workdir={workdir}',
                    f'--train_steps={steps}', '--log_every=5',
                    '--checkpoint_every=5', '--eval_every=100000')
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout.decode().strip() == (
        f'train.py: --train_steps={steps}: the run in {workdir} is already at '
        f'step 10{" with its results written" if steps == 10 else ""}; '
        'nothing to train (raise --train_steps to go on, or use --fresh or '
        'another --workdir to start over).')
    assert 'Traceback' not in result.stderr.decode()
  assert {name: (workdir / name).read_bytes() for name in before} == before
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['10', '5']


def _tokens(workdir) -> dict:
  return {path.name: path.read_bytes()
          for path in sorted((workdir / 'tokens').iterdir())}


@needs_multi30k
def test_an_interrupted_preparation_is_finished_by_the_same_command(
    data_slice, tmp_path, monkeypatch):
  # [prepare_interrupted_then_rerun] Ctrl-C while tokenizing, while the
  # vocabulary is written, or (by an earlier version) before any record:
  # the same preparation again finishes it, keeping a vocabulary that reads
  # back whole, and makes what an uninterrupted one makes.
  config = tiny_translation_config()
  source = prepared_lib.Source(str(data_slice))
  clean = tmp_path / 'clean'
  with Workdir(str(clean)) as held:
    prepared_lib.prepare(config, held, source)
  real_write = tokenized.write_split

  def interrupted_write(directory, split, chunks, vocab_size):
    def some(chunks):
      yield next(iter(chunks))
      raise KeyboardInterrupt
    real_write(directory, split, some(chunks), vocab_size)

  workdir = tmp_path / 'run'
  monkeypatch.setattr(tokenized, 'write_split', interrupted_write)
  with Workdir(str(workdir)) as held, pytest.raises(KeyboardInterrupt):
    prepared_lib.prepare(config, held, source)
  monkeypatch.setattr(tokenized, 'write_split', real_write)
  vocabulary = (workdir / 'spm.model').stat().st_mtime_ns
  assert not tokenized.is_complete(str(workdir / 'tokens'), 'train')
  with Workdir(str(workdir)) as held:
    data = prepared_lib.prepare(config, held, source)
  assert (workdir / 'spm.model').stat().st_mtime_ns == vocabulary  # kept
  assert len(data.train) == 302 and _tokens(workdir) == _tokens(clean)
  assert json.loads((workdir / 'prepared.json').read_text())['complete']
  # The vocabulary cut short as it was written: trained again.
  (workdir / 'prepared.json').write_text(json.dumps(
      {**json.loads((workdir / 'prepared.json').read_text()),
       'complete': False}))
  _cut_in_half(workdir / 'spm.model')
  shutil.rmtree(workdir / 'tokens')
  with Workdir(str(workdir)) as held:
    prepared_lib.prepare(config, held, source)
  assert _tokens(workdir) == _tokens(clean)
  # What e577ba4 left, with no record at all: set aside, prepared anew.
  leftovers = tmp_path / 'old'
  leftovers.mkdir()
  (leftovers / 'spm.model').write_bytes((clean / 'spm.model').read_bytes())
  (leftovers / 'tokens').mkdir()
  (leftovers / 'tokens' / 'train.src.ids').write_bytes(b'\0' * 100)
  result = _train(*tiny_translation_flags(train_steps=1, log_every=1,
                                          eval_every=100, average_last=0),
                  f'--data_dir={data_slice}', f'--workdir={leftovers}')
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  (aside,) = [p for p in leftovers.iterdir()
              if p.name.startswith('set-aside-')]
  assert (f'an interrupted preparation that did not record what it was '
          f'prepared from is now in {aside}; preparing anew'
          ) in result.stdout.decode()
  assert sorted(os.listdir(aside)) == ['spm.model', 'tokens']
  assert _tokens(leftovers) == _tokens(clean)


@needs_multi30k
def test_a_file_edited_in_place_with_its_size_and_times_kept_is_seen(
    data_slice, tmp_path):
  # [data_edited_same_size_and_mtime] Two lines swapped, the modification
  # time set back (as cp -p, rsync -a, tar x and touch -r do): refused as
  # other data, not trained on as the old pairs.
  data = tmp_path / 'data'
  shutil.copytree(data_slice, data)
  config = tiny_translation_config()
  with Workdir(str(tmp_path / 'run')) as held:
    prepared_lib.prepare(config, held, prepared_lib.Source(str(data)))
  path = data / 'val.en'
  status = path.stat()
  lines = path.read_text(encoding='utf-8').splitlines(keepends=True)
  lines[0], lines[1] = lines[1], lines[0]
  path.write_text(''.join(lines), encoding='utf-8')
  os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
  assert (path.stat().st_size, path.stat().st_mtime_ns) == (
      status.st_size, status.st_mtime_ns)
  with Workdir(str(tmp_path / 'run')) as held, pytest.raises(
      WorkdirError, match="other data or settings \\(the data's contents"):
    prepared_lib.prepare(config, held, prepared_lib.Source(str(data)))


@contextlib.contextmanager
def _small_disk(path, kilobytes: int):
  """A disk of `kilobytes` mounted at `path` (a tmpfs); skips where this
  process may not mount one."""
  path.mkdir()
  mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={kilobytes}k',
                            'tmpfs', str(path)], capture_output=True,
                           text=True, check=False)
  if mounted.returncode:
    pytest.skip(f'cannot mount a small disk here: {mounted.stderr.strip()}')
  try:
    yield path
  finally:
    subprocess.run(['umount', '-l', str(path)], check=False)


def test_a_full_disk_while_saving_is_one_line_and_the_rerun_goes_on(
    tmp_path):
  # [disk_full_saving] Room for the checkpoints of steps 5 and 10, not 15:
  # one line naming the folder and the last intact checkpoint, exit code 1,
  # nothing drawn or written after it; with room, the same command resumes.
  args = ['--task=copy', '--train_steps=20', '--log_every=5',
          '--checkpoint_every=5', '--eval_every=100000']
  with _small_disk(tmp_path / 'disk', 3200) as small:
    full = _train(*args, f'--workdir={small / "run"}')
    _last_line_error(full, 1, f'train.py: error: no space left on the disk of '
                     f'{small / "run" / "checkpoints"} (checkpoint 15 needs '
                     'about', 'free some and run the same command again: the '
                     'checkpoints up to step 10 are intact.')
    assert sorted(os.listdir(small / 'run' / 'checkpoints')) == ['10', '5']
    assert not (small / 'run' / 'curves.png').exists()
    assert not (small / 'run' / 'results.json').exists()
    shutil.copytree(small / 'run', tmp_path / 'run')
  again = _train(*args, f'--workdir={tmp_path / "run"}')
  assert again.returncode == 0, again.stderr.decode()[-3000:]
  assert 'resuming from step 10' in again.stdout.decode()
  assert json.loads((tmp_path / 'run' / 'results.json').read_text())[
      'steps'] == 20


@needs_multi30k
def test_a_full_disk_while_preparing_is_one_line_and_the_rerun_finishes(
    data_slice, tmp_path):
  # [disk_full_preparing] No room for the vocabulary: one line, exit code
  # 1; with room, the same command finishes the preparation and trains.
  args = [*tiny_translation_flags(train_steps=1, log_every=1, eval_every=100,
                                  average_last=0), f'--data_dir={data_slice}']
  with _small_disk(tmp_path / 'disk', 200) as small:
    full = _train(*args, f'--workdir={small / "run"}')
    _last_line_error(full, 1, 'train.py: error: no space left on the disk of '
                     f'{small / "run"}', 'free some and run the same command '
                     'again: the preparation goes on where it stopped.')
    assert not (small / 'run' / 'spm.model').exists()
    shutil.copytree(small / 'run', tmp_path / 'run')
  again = _train(*args, f'--workdir={tmp_path / "run"}')
  assert again.returncode == 0, again.stderr.decode()[-3000:]
  assert 'finishing the preparation that was interrupted' in (
      again.stdout.decode())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _processes(*flags, count: int = 2) -> list[subprocess.Popen]:
  """train.py started as every process of a multi-host run on this machine
  (one CPU device each)."""
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS='--xla_force_host_platform_device_count=1')
  return [subprocess.Popen(
      [sys.executable, os.path.join(ROOT, 'train.py'), *flags,
       f'--coordinator_address=localhost:{port}', f'--num_processes={count}',
       f'--process_id={index}'], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE) for index in range(count)]


def _no_runtime_noise(err: str) -> None:
  for noise in ('Traceback', 'Check failure', 'Gloo context', 'F1', 'E1'):
    assert noise not in err, err[-3000:]


@pytest.mark.parametrize('lost', [1, 0])
def test_a_multihost_run_whose_peer_dies_ends_in_one_line(tmp_path, lost):
  # [multihost_peer_killed] The other process ends at once (not after
  # JAX's shutdown barrier times out, about 80 s), in one line that names the
  # process that stopped, the last checkpoint and what to do; no Gloo error
  # and no C++ stack trace. Process 0 (which holds JAX's coordination
  # service) or another.
  workers = _processes('--task=copy', '--config=toy', f'--workdir={tmp_path}',
                       '--train_steps=100000', '--eval_every=100000',
                       '--checkpoint_every=20', '--log_every=10')
  try:
    deadline = time.time() + 300
    while not (tmp_path / 'checkpoints' / '40').exists():
      assert time.time() < deadline and all(w.poll() is None for w in workers)
      time.sleep(0.2)
    workers[lost].kill()  # as a machine lost: SIGKILL, no last word
    killed = time.perf_counter()
    survivor = workers[1 - lost]
    _, err = survivor.communicate(timeout=120)
  finally:
    for worker in workers:
      worker.kill()
  assert time.perf_counter() - killed < 30
  err = err.decode()
  assert survivor.returncode == 1, err[-3000:]
  _no_runtime_noise(err)
  last = err.strip().splitlines()[-1]
  step = max(int(name) for name in os.listdir(tmp_path / 'checkpoints')
             if name.isdigit())
  assert last.startswith(f'train.py: error: process {lost} of this '
                         'multi-host run stopped ('), last
  assert last.endswith(f'), so process {1 - lost} stops too; the last '
                       f'checkpoint is step {step}: start every process '
                       'again with the same command.'), last


@needs_multi30k
def test_process_0_refusing_its_data_ends_every_process_in_one_line(
    data_slice, tmp_path):
  # [multihost_prepare_error] Process 0 refuses the data (one line); the
  # other, waiting for its preparation, says so in one line at once, not a
  # DEADLINE_EXCEEDED traceback 30 s later.
  data = tmp_path / 'data'
  shutil.copytree(data_slice, data)
  (data / 'val.en').write_text('one line only\n')
  started = time.perf_counter()
  workers = _processes(*tiny_translation_flags(), f'--data_dir={data}',
                       f'--workdir={tmp_path / "run"}')
  outputs = [w.communicate(timeout=300) for w in workers]
  assert time.perf_counter() - started < 120
  errs = [err.decode() for _, err in outputs]
  for worker, err in zip(workers, errs):
    assert worker.returncode == 1, err[-3000:]
    _no_runtime_noise(err)
  refusal = errs[0].strip().splitlines()[-1]
  assert refusal.startswith('train.py: error: ') and 'val.en' in refusal
  assert errs[1].strip().splitlines()[-1] == (
      'train.py: error: process 0 stopped while preparing the data ('
      f'{refusal.removeprefix("train.py: error: ")[:300]}); see its log, '
      'mend that, and start every process again with the same command.')
