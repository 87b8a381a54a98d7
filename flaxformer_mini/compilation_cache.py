"""Compiled programs kept on disk for train.py and the translate command.

Two layers. The persistent XLA compilation cache (`use`): a rerun (a resumed
run, the next translate call) skips XLA's compilation, which takes seconds
per program on a CPU host, but still traces and lowers every program.
`Executables`: the translate command's own programs serialized whole
(jax.experimental.serialize_executable), so a later process loads them in
milliseconds with no tracing, lowering or compiling at all; and the shapes
of the model's parameters that loading a run checks its checkpoint against
(`Executables.params_shape`), which would otherwise trace the model's init.

Their files share one folder, kept to `MAX_BYTES` (`prune`): every
start and every program written removes the least recently used first, as
each version of the code, each shape and each model leaves its own.
"""

import contextlib
import functools
import glob
import hashlib
import json
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable

from flaxformer_mini import disk

_DEFAULT_DIR = os.environ.get('JAX_COMPILATION_CACHE_DIR', os.path.join(
    os.path.expanduser('~'), '.cache', 'flaxformer_mini', 'xla'))
_SUFFIX = '.executable'
# The parameters' shapes of a config (`Executables.params_shape`).
_SHAPES_SUFFIX = '.shapes.json'
# XLA's persistent cache names its files <program>-<key>-cache.
_XLA_SUFFIX = '-cache'
# What the folder may hold: hundreds of a small model's programs, tens of a
# big one's; a program removed costs the next process one compile.
MAX_BYTES = 1 << 30
# Every program this process has compiled or loaded, by its file's path:
# loaded or compiled once per process, whatever the store (XLA's CPU runtime
# cannot run a program loaded into the process that compiled the same one).
_IN_PROCESS: dict[str, Any] = {}


def add_flag(parser) -> None:
  """--compilation_cache on an argparse parser (the folder, or '' for none)."""
  parser.add_argument(
      '--compilation_cache', default=_DEFAULT_DIR,
      help='persistent compilation cache: a rerun loads the compiled '
      'programs instead of compiling them again, the least recently used '
      f'removed past {MAX_BYTES >> 30} GiB ("" turns it off; default '
      '%(default)s).')


def use(directory: str, max_bytes: int = MAX_BYTES) -> None:
  """Keeps every program compiled from now on in `directory` ('': none),
  the folder pruned to max_bytes first (`prune`)."""
  if directory:
    import jax  # pylint: disable=g-import-not-at-top
    prune(directory, max_bytes)
    jax.config.update('jax_compilation_cache_dir', directory)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)


def prune(directory: str, max_bytes: int = MAX_BYTES, keep: str = '') -> None:
  """Removes the least recently used compiled programs of `directory` (XLA's
  and `Executables`', with the parameters' shapes it keeps) until the rest
  hold at most max_bytes; never `keep`.

  Last use is a file's access or modification time, whichever is later
  (a program loaded by `Executables` is touched). Half-written programs
  an hour old (a writer that died) go too. Left alone: any other file, and
  whatever cannot be read or removed (a read-only folder, a file another
  process removed first).
  """
  programs, dead = [], time.time() - 3600
  for path in glob.glob(os.path.join(directory, '*')):
    try:
      stat = os.stat(path)
    except OSError:
      continue
    if path.endswith((_SUFFIX, _XLA_SUFFIX, _SHAPES_SUFFIX)):
      programs.append((max(stat.st_atime, stat.st_mtime), stat.st_size, path))
    elif path.endswith(disk.PARTIAL) and stat.st_mtime < dead:
      _remove(path)
  total = sum(size for _, size, _ in programs)
  for _, size, path in sorted(programs):
    if total <= max_bytes:
      break
    if path != keep and _remove(path):
      total -= size


def _remove(path: str) -> bool:
  """Whether `path` could be removed (it may be gone already, or the folder
  read-only)."""
  try:
    os.remove(path)
    return True
  except OSError:
    return False


def _digest(*parts) -> str:
  return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


@functools.cache
def _code_digest() -> str:
  """The package's source: a program compiled by other code is not ours."""
  folder = os.path.dirname(os.path.abspath(__file__))
  sha = hashlib.sha256()
  for path in sorted(glob.glob(os.path.join(folder, '**', '*.py'),
                               recursive=True)):
    with open(path, 'rb') as f:
      sha.update(f.read())
  return sha.hexdigest()[:16]


def _environment() -> str:
  """What a serialized executable only runs under: jax, jaxlib, the
  backend and its devices, XLA's flags."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  return (f'jax {jax.__version__}, jaxlib {jaxlib.__version__}, '
          f'{device.platform} ({device.client.platform_version.strip()}, '
          f'{jax.device_count()} x {device.device_kind}), '
          f'XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r}, '
          f'Python {sys.version_info.major}.{sys.version_info.minor}')


def _placement(leaf) -> str:
  """Where an argument lies. On one device every placement is the same one,
  which XLA may name in more than one way (a split over a mesh of one device,
  or none), and a program compiled for one runs with the others."""
  sharding = getattr(leaf, 'sharding', None)
  if sharding is None or len(sharding.device_set) > 1:
    return str(sharding or '')
  [device] = sharding.device_set
  return f'{device} ({sharding.memory_kind})'


def _signature(tree) -> str:
  """The structure, shapes, dtypes and placements of a call's arguments."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return repr((str(treedef), [
      (np.shape(leaf), str(getattr(leaf, 'dtype', type(leaf))),
       getattr(leaf, 'weak_type', False), _placement(leaf))
      for leaf in leaves]))


# Compilations under way without XLA's persistent cache, on any thread, and
# whether the cache was on before the first of them.
_AFRESH = {'count': 0, 'enabled': False}
_AFRESH_LOCK = threading.Lock()


def _persistent_cache(on: bool) -> None:
  # pylint: disable=g-import-not-at-top
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  # pylint: enable=g-import-not-at-top
  jax.config.update('jax_enable_compilation_cache', on)
  # The cache decides once per process whether it is on: reset, it asks again.
  compilation_cache.reset_cache()


def _compile_afresh(jitted, args, static,
                    lowered: Callable[[Any], None] = lambda out: None):
  """jitted compiled for args by XLA itself, never handed back by the
  persistent cache: a program loaded from there serializes into a file that
  does not run (XLA's CPU runtime, jax 0.10: 'Function ... not found').
  Two threads may compile at once (`Executables.ahead`): the cache is off
  from the first one's start to the last one's end. lowered(the program's
  result as jax.ShapeDtypeStructs) is called once it is traced and
  lowered, before XLA compiles it."""
  import jax  # pylint: disable=g-import-not-at-top
  program = jitted.trace(*args, **static)
  with _AFRESH_LOCK:
    if not _AFRESH['count']:
      _AFRESH['enabled'] = jax.config.jax_enable_compilation_cache
      _persistent_cache(False)
    _AFRESH['count'] += 1
  try:
    lowering = program.lower()
    # Not before: what starts here (a later program's tracing) is Python,
    # as lowering is, and the two would take turns on its lock, where XLA's
    # compiling runs beside it (docs/performance.md).
    lowered(program.out_info)
    return lowering.compile()
  finally:
    with _AFRESH_LOCK:
      _AFRESH['count'] -= 1
      if not _AFRESH['count']:
        _persistent_cache(_AFRESH['enabled'])


def _at_hand(path: str) -> bool:
  """Whether the program of `path` is loaded in this process or kept there."""
  return path in _IN_PROCESS or os.path.exists(path)


class Executables:
  """A jitted function's compiled programs, loaded from `directory` where a
  process (this one or an earlier one) compiled them for the same code,
  arguments and environment, else compiled and written there.

  `executables(name, jitted, *args, **static)` is `jitted(*args, **static)`
  for a jax.jit function whose keyword arguments `static` are static. A
  program found for another jax version or backend is left as it is and
  compiled again for this one, and a file that does not load is compiled
  again, each with one line to `note`. Each program written prunes the
  folder to max_bytes (`prune`); each loaded is marked as used.

  `ahead` compiles a program that a later call will need on a thread of its
  own, beside whatever the process does meanwhile: XLA's compiler keeps
  about one core busy, so a process that must compile two programs (the
  translate command's stages) compiles them at once.
  """

  def __init__(self, directory: str,
               note: Callable[[str], None] = lambda line: None,
               max_bytes: int = MAX_BYTES):
    self.directory = directory
    self._note = note
    self._max_bytes = max_bytes
    self._code = _code_digest()
    self._environment = _environment()
    self._ahead: dict[str, list[threading.Thread]] = {}
    # Compiles to start once a program is lowered: its name -> the starters.
    self._after: dict[str, list[Callable[[Any], None]]] = {}

  def _call_path(self, name: str, args, static) -> tuple[str, str]:
    """(the program's digest, its file) for a call with args and static."""
    program = _digest(self._code, name, sorted(static.items()),
                      _signature(args))
    return program, self._path(name, program, _digest(self._environment))

  def ahead(self, name: str, jitted, arguments: Callable[[Any], tuple], *,
            after: str, **static) -> None:
    """Once this process's next call of program `after` has traced and
    lowered it to compile it, compiles on a thread of its own the program
    of a later call self(name, jitted, *args, **static), beside XLA's
    compiling of `after`; that later call waits for it instead of
    compiling.

    arguments(`after`'s result as jax.ShapeDtypeStructs) runs on that thread
    and gives args or their jax.ShapeDtypeStructs (shapes, dtypes,
    placements): foreseen from `after`'s trace, not by tracing `after` once
    more. Where the call of `after` compiles nothing (its program loaded),
    nothing is compiled ahead. Where the program is at hand already, nothing
    is compiled; where the arguments do not match the later call's, or
    anything on that thread fails, only its work is lost: the call
    compiles, as it would have."""
    def compile_ahead(result):
      try:
        args = arguments(result)
        _, path = self._call_path(name, args, static)
        if _at_hand(path):
          return
        compiled = _compile_afresh(jitted, args, static)
        _IN_PROCESS.setdefault(path, compiled)
        self._write(name, path, compiled)
      except Exception:  # pylint: disable=broad-except
        pass  # the call compiles it, as it would have without this
    def start(result):
      # Not a daemon: a process that ends first waits for the compiler,
      # whose program is then kept for the next one.
      thread = threading.Thread(target=compile_ahead, args=(result,),
                                name=f'ahead {name}')
      self._ahead.setdefault(name, []).append(thread)
      thread.start()
    self._after.setdefault(after, []).append(start)

  def __call__(self, name: str, jitted, *args, **static):
    import jax  # pylint: disable=g-import-not-at-top
    for thread in self._ahead.pop(name, ()):
      thread.join()
    starters = self._after.pop(name, [])  # started only where this compiles
    program, path = self._call_path(name, args, static)
    if path in _IN_PROCESS:
      return _IN_PROCESS[path](*args)
    compiled = self._load(name, program, path)
    if compiled is not None:
      try:
        result = compiled(*args)
        _IN_PROCESS[path] = compiled
        return result
      except jax.errors.JaxRuntimeError as e:  # loads, but cannot run
        if 'RESOURCE_EXHAUSTED' in str(e):
          raise
        self._note(f'the compiled {name} in {path} did not run '
                   f'({str(e).splitlines()[0][:80]}); compiling it again.')
    def start_ahead(result):  # the compiles waiting on this one's lowering
      for start in starters:
        start(result)
    compiled = _IN_PROCESS[path] = _compile_afresh(jitted, args, static,
                                                   lowered=start_ahead)
    self._write(name, path, compiled)
    return compiled(*args)

  def params_shape(self, config):
    """`checkpoints.params_shape(config)`, kept in the folder: a later
    process reads the shapes and dtypes of the model's parameters, which a
    run's checkpoint is checked against as it loads, instead of tracing the
    model's init for them (a quarter of a second of every warm translate
    command, the only tracing left there; docs/performance.md). Kept per
    version of the code, config, environment and Flax; a file that does
    not read is traced again and written over."""
    # pylint: disable=g-import-not-at-top
    import flax
    import jax
    from flaxformer_mini import checkpoints
    # pylint: enable=g-import-not-at-top
    # Flax names and shapes the parameters: its version is part of the key.
    path = os.path.join(self.directory, 'params_shape-' + _digest(
        self._code, repr(config), self._environment, flax.__version__) +
                        _SHAPES_SUFFIX)
    leaf = lambda x: isinstance(x, list)  # [shape, dtype]
    try:
      with open(path, encoding='utf-8') as f:
        shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(tuple(x[0]), x[1]), json.load(f),
            is_leaf=leaf)
      with contextlib.suppress(OSError):
        os.utime(path)  # used now: the last that `prune` removes
      return shapes
    except (OSError, ValueError, TypeError, IndexError):
      pass
    shapes = checkpoints.params_shape(config)
    try:
      os.makedirs(self.directory, exist_ok=True)
      with disk.written_whole(path, 'w') as f:
        json.dump(jax.tree.map(lambda x: [list(x.shape), str(x.dtype)],
                               shapes), f)
    except OSError:
      pass  # the next process traces them again
    return shapes

  def _load(self, name: str, program: str, path: str):
    """The program at `path`, or None (noted where one was made elsewhere,
    or the file does not load)."""
    # pylint: disable=g-import-not-at-top
    from jax.experimental import serialize_executable
    # pylint: enable=g-import-not-at-top
    if os.path.exists(path):
      try:
        with open(path, 'rb') as f:
          _, payload, in_tree, out_tree = pickle.load(f)
        compiled = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree)
        try:
          os.utime(path)  # used now: the last that `prune` removes
        except OSError:
          pass
        return compiled
      except Exception as e:  # pylint: disable=broad-except
        self._note(f'the compiled {name} in {path} did not load '
                   f'({type(e).__name__}); compiling it again.')
        return None
    for other in glob.glob(self._path(name, program, '*')):
      try:
        with open(other, 'rb') as f:
          environment = pickle.load(f)[0]
      except Exception:  # pylint: disable=broad-except
        continue
      self._note(f'the compiled {name} in {self.directory} was made for '
                 f'{environment}; compiling it for {self._environment}.')
      break
    return None

  def _path(self, name: str, program: str, environment: str) -> str:
    return os.path.join(self.directory,
                        f'{name}-{program}-{environment}{_SUFFIX}')

  def _write(self, name: str, path: str, compiled) -> None:
    """Writes the program beside `path` and renames it there: a reader
    never sees half a file. A program that cannot be serialized, or a
    folder that cannot be written, only costs the next process a compile."""
    # pylint: disable=g-import-not-at-top
    from jax.experimental import serialize_executable
    # pylint: enable=g-import-not-at-top
    try:
      payload, in_tree, out_tree = serialize_executable.serialize(compiled)
      os.makedirs(self.directory, exist_ok=True)
      with disk.written_whole(path, 'wb') as f:
        pickle.dump((self._environment, payload, in_tree, out_tree), f)
      prune(self.directory, self._max_bytes, keep=path)
    except (OSError, ValueError, NotImplementedError, pickle.PicklingError,
            TypeError) as e:
      reason = (e.strerror if isinstance(e, OSError) and e.strerror
                else f'{type(e).__name__}: {e}')
      self._note(f'the compiled {name} could not be kept in '
                 f'{self.directory} ({reason}); the next run compiles it '
                 'again.')
