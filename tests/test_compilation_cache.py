"""Compiled programs kept whole on disk: a later process calls them without
tracing, a program made elsewhere is compiled again beside it, with a note.

Each process is a subprocess: a process runs a program it compiled or
loaded, never both.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from flaxformer_mini import compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process: calls a jitted function with a static keyword through a store
# on FOLDER, for each (length, power) of CALLS; prints how often it traced,
# the notes and the results.
_PROCESS = '''
import json, sys
import jax, jax.numpy as jnp
from flaxformer_mini import compilation_cache
folder, calls, environment, code, plain, max_bytes = json.loads(sys.argv[1])
if environment:
  compilation_cache._environment = lambda: environment
if code:
  compilation_cache._code_digest = lambda: code
traced, notes = [], []
def scaled_sum(x, y, *, power):
  traced.append(power)
  return {'sum': (x ** power).sum() + y, 'rows': x.shape[0] * y}
program = jax.jit(scaled_sum, static_argnames='power')
store = compilation_cache.Executables(folder, notes.append,
                                      max_bytes or compilation_cache.MAX_BYTES)
if plain:  # jax's own jit, without the store
  store = lambda name, program, *args, **static: program(*args, **static)
results = [float(store('f', program, jnp.arange(float(length)),
                       jnp.float32(2), power=power)['sum'])
           for length, power in calls]
print(json.dumps({'traced': traced, 'notes': notes, 'results': results,
                  'environment': compilation_cache._environment()}))
'''


def _process(folder, calls, environment='', code='', plain=False, env=None,
             max_bytes=0):
  result = subprocess.run(
      [sys.executable, '-c', _PROCESS,
       json.dumps([str(folder), calls, environment, code, plain, max_bytes])],
      capture_output=True, text=True, cwd=ROOT, timeout=300,
      env={**os.environ, **(env or {})})
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.splitlines()[-1])


def _expected(length, power):
  return float(sum(i**power for i in range(length)) + 2)


def test_a_later_process_calls_the_kept_programs_without_tracing(tmp_path):
  first = _process(tmp_path, [[6, 3], [6, 3], [4, 3]])
  assert first['traced'] == [3, 3]  # once per shape
  assert first['results'] == [_expected(6, 3)] * 2 + [_expected(4, 3)]
  assert len(os.listdir(tmp_path)) == 2
  later = _process(tmp_path, [[6, 3], [4, 3], [6, 2]])
  assert later['traced'] == [2]  # only the program no process had made
  assert later['results'] == [_expected(6, 3), _expected(4, 3),
                              _expected(6, 2)]
  assert later['notes'] == [] and len(os.listdir(tmp_path)) == 3


def test_a_program_that_xla_s_persistent_cache_holds_is_kept_so_it_runs(
    tmp_path):
  """A program the persistent cache handed back would be written in a form
  that does not run (jax 0.10's CPU runtime): the store compiles afresh."""
  cache = {'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'xla_cache')}
  _process(tmp_path / 'unused', [[6, 3]], plain=True, env=cache)
  assert os.listdir(tmp_path / 'xla_cache')
  _process(tmp_path / 'kept', [[6, 3]], env=cache)
  later = _process(tmp_path / 'kept', [[6, 3]], env=cache)
  assert later['notes'] == [] and later['traced'] == []
  assert later['results'] == [_expected(6, 3)]


def test_a_program_made_for_another_jax_or_backend_is_compiled_again_beside_it(
    tmp_path):
  _process(tmp_path, [[6, 3]], environment='jax 0.0.1, tpu (v9)')
  [elsewhere] = os.listdir(tmp_path)
  made_elsewhere = (tmp_path / elsewhere).read_bytes()
  here = _process(tmp_path, [[6, 3]])
  assert here['traced'] == [3] and here['results'] == [_expected(6, 3)]
  assert here['notes'] == [
      f'the compiled f in {tmp_path} was made for jax 0.0.1, tpu (v9); '
      f'compiling it for {here["environment"]}.']
  assert (tmp_path / elsewhere).read_bytes() == made_elsewhere  # kept
  assert len(os.listdir(tmp_path)) == 2
  assert _process(tmp_path, [[6, 3]])['traced'] == []


def test_a_file_that_does_not_load_is_compiled_again_with_a_note(tmp_path):
  _process(tmp_path, [[6, 3]])
  [name] = os.listdir(tmp_path)
  (tmp_path / name).write_bytes(b'not a program')
  again = _process(tmp_path, [[6, 3]])
  assert again['traced'] == [3] and again['results'] == [_expected(6, 3)]
  assert again['notes'] == [f'the compiled f in {tmp_path / name} did not '
                            'load (UnpicklingError); compiling it again.']
  assert _process(tmp_path, [[6, 3]]) ['traced'] == []  # whole again


def test_a_program_of_other_code_is_not_loaded(tmp_path):
  _process(tmp_path, [[6, 3]])
  edited = _process(tmp_path, [[6, 3]], code='edited')
  assert edited['traced'] == [3] and edited['notes'] == []
  assert len(os.listdir(tmp_path)) == 2


def test_a_folder_that_cannot_be_written_costs_a_compile_and_a_note(tmp_path):
  blocked = tmp_path / 'file'
  blocked.write_text('')
  result = _process(blocked / 'xla', [[3, 1]])
  assert result['results'] == [_expected(3, 1)]
  assert result['notes'] == [
      f'the compiled f could not be kept in {blocked / "xla"} (Not a '
      'directory); the next run compiles it again.']


def test_the_folder_keeps_to_its_size_the_least_recently_used_going_first(
    tmp_path):
  _process(tmp_path, [[6, 3], [4, 3]])
  sizes = {name: (tmp_path / name).stat().st_size
           for name in os.listdir(tmp_path)}
  # A third program would not fit beside both: the one loaded now stays,
  # the one not used since goes.
  later = _process(tmp_path, [[6, 3], [5, 3]],
                   max_bytes=sum(sizes.values()) + max(sizes.values()) // 2)
  assert later['traced'] == [3] and later['notes'] == []
  kept = set(os.listdir(tmp_path))
  assert len(kept) == 2 and len(kept & set(sizes)) == 1
  again = _process(tmp_path, [[6, 3], [5, 3], [4, 3]])
  assert again['traced'] == [3]  # only the one removed: [4, 3]
  assert again['results'] == [_expected(6, 3), _expected(5, 3),
                              _expected(4, 3)]


def test_pruning_keeps_other_files_and_removes_dead_writers_files(tmp_path):
  old = 1_000_000_000  # 2001: long unused
  for name, size in [('a.executable', 300), ('b-key-cache', 300),
                     ('c.executable', 300), ('notes.txt', 5000),
                     ('tmp1.partial', 10), ('tmp2.partial', 10)]:
    (tmp_path / name).write_bytes(b'x' * size)
  for name, when in [('a.executable', old), ('b-key-cache', old + 1),
                     ('tmp1.partial', old)]:
    os.utime(tmp_path / name, (when, when))
  compilation_cache.prune(str(tmp_path), max_bytes=600)
  # a went first; b, used after it, is kept; a partial being written now too.
  assert sorted(os.listdir(tmp_path)) == [
      'b-key-cache', 'c.executable', 'notes.txt', 'tmp2.partial']
  compilation_cache.prune(str(tmp_path), max_bytes=0, keep=str(
      tmp_path / 'c.executable'))
  assert sorted(os.listdir(tmp_path)) == ['c.executable', 'notes.txt',
                                          'tmp2.partial']


def test_the_parameters_shapes_are_kept_and_read_without_tracing(
    tmp_path, monkeypatch):
  """Loading a run checks its checkpoint against the model's parameters'
  shapes: a later process reads them from the folder instead of tracing
  the model's init; a damaged file is traced again and written whole."""
  from flaxformer_mini import checkpoints  # pylint: disable=g-import-not-at-top
  from conftest import tiny_translation_config  # pylint: disable=g-import-not-at-top
  config = tiny_translation_config()
  traced = checkpoints.params_shape(config)
  assert compilation_cache.Executables(str(tmp_path)).params_shape(
      config) == traced
  [kept] = tmp_path.glob('*.shapes.json')
  def no_tracing(config):
    raise AssertionError(f'traced the init of {config}')
  monkeypatch.setattr(checkpoints, 'params_shape', no_tracing)
  later = compilation_cache.Executables(str(tmp_path))
  assert later.params_shape(config) == traced
  # Another config's shapes are not these: it traces.
  with pytest.raises(AssertionError, match='traced the init'):
    later.params_shape(config.replace(d_ff=128))
  kept.write_text(kept.read_text()[:40])
  monkeypatch.undo()
  assert later.params_shape(config) == traced
  assert jax.tree.map(lambda x: [list(x.shape), str(x.dtype)], traced) == (
      json.loads(kept.read_text()))
  compilation_cache.prune(str(tmp_path), max_bytes=0)  # kept as programs are
  assert not list(tmp_path.glob('*.shapes.json'))


def test_the_key_names_what_a_program_only_runs_under():
  environment = compilation_cache._environment()  # pylint: disable=protected-access
  for part in ('jax ', 'jaxlib ', 'cpu', 'XLA_FLAGS=', 'Python '):
    assert part in environment


# One process of two devices: translates sources of many lengths through a
# store on FOLDER, in stages, and again without it; prints which programs it
# compiled on which thread, and what it called.
_STAGES = '''
import json, sys, threading
import jax, numpy as np
from flaxformer_mini import compilation_cache, translation
from flaxformer_mini.config import get_config
from flaxformer_mini.training import init_params
assert jax.local_device_count() == int(sys.argv[2]), jax.devices()
cfg = get_config('toy')
params = init_params(cfg, jax.random.key(0))
rng = np.random.default_rng(0)
sources = [rng.integers(cfg.first_ordinary_id, cfg.src_vocab_size,
                        size=n).tolist()
           for n in rng.integers(1, 9, 32 * jax.local_device_count())]
compiled, called = [], []
afresh = compilation_cache._compile_afresh
def logged(jitted, args, static, **lowered):
  compiled.append([jitted.__name__, threading.current_thread().name])
  return afresh(jitted, args, static, **lowered)
compilation_cache._compile_afresh = logged
call = compilation_cache.Executables.__call__
def counted(self, name, *args, **static):
  called.append(name)
  return call(self, name, *args, **static)
compilation_cache.Executables.__call__ = counted
ahead = compilation_cache.Executables.ahead
def counted_ahead(self, name, *args, **static):
  called.append('ahead ' + name)
  return ahead(self, name, *args, **static)
compilation_cache.Executables.ahead = counted_ahead
store = compilation_cache.Executables(sys.argv[1])
cache_on = jax.config.jax_enable_compilation_cache
translate = lambda executables: translation.translate_ids(
    params, cfg, sources, beam_size=2, batch_size=32, stopping='exact',
    executables=executables)
report = {'same': translate(store) == translate(None),
          'compiled': sorted(compiled), 'called': called[:],
          'cache_restored': jax.config.jax_enable_compilation_cache == cache_on}
del compiled[:], called[:]
translate(store)  # its programs at hand: nothing compiled, nothing ahead
print(json.dumps({**report, 'again': [compiled, called]}))
'''


@pytest.mark.parametrize('devices', [1, 2])
def test_a_process_compiles_the_later_stage_beside_the_first(tmp_path,
                                                             devices):
  """The translate command's store compiles the later stage of its search on
  a thread of its own while the first stage compiles (about 1.7 s of the
  test set's 19 s cold, docs/performance.md), and the search calls that
  program: one compile each, the same translations, all kept. On one
  device too, where XLA names the first stage's state's placement otherwise
  than the foreseen one (the same placement). This untrained model's
  sentences run on: its first stage stops at its cache's last window with
  more than a quarter of them searching, and they go on at its width first,
  in a third program that the search compiles when it needs it."""
  result = subprocess.run(
      [sys.executable, '-c', _STAGES, str(tmp_path), str(devices)],
      capture_output=True, text=True, cwd=ROOT, timeout=600,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu',
           'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}'})
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.splitlines()[-1])
  assert report['same'] and report['cache_restored']
  stages = ['ahead later_stage', 'first_stage', 'later_stage', 'later_stage']
  assert report['called'] == stages
  assert report['compiled'] == [['_first_stage', 'MainThread'],
                                ['_later_stage', 'MainThread'],
                                ['_later_stage', 'ahead later_stage']]
  assert report['again'] == [[], stages]
  assert len(os.listdir(tmp_path)) == 3
