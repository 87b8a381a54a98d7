"""Shared fixtures: the walkthrough's toy model and a batch of two pairs.

The suite shares one persistent XLA compilation cache (also inherited by the
subprocesses it starts): many tests compile the same steps, and loading a
compiled program is far cheaper than compiling it again on a 2-core machine.
"""

import dataclasses
import fcntl
import functools
import gzip
import json
import os
import shutil
import tempfile

os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(
    tempfile.gettempdir(), 'flaxformer_mini_test_jax_cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import pytest

# The suite checks equalities between two ways of computing the same thing;
# on a GPU float32 matmuls default to TF32 (10-bit mantissa), which would
# turn those into 1e-4-level noise. Full float32 keeps them exact anywhere
# (on CPU this changes nothing).
jax.config.update('jax_default_matmul_precision', 'highest')

import numpy as np

from flaxformer_mini import loop
from flaxformer_mini.config import get_config
from flaxformer_mini.data import copy_task
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.tasks import train_copy
from flaxformer_mini.training import create_train_state, init_params


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where CI keeps the real data: ../shared/data/multi30k beside the project.
MULTI30K = os.path.join(os.path.dirname(ROOT), 'shared', 'data', 'multi30k')


def multi30k_lines(split, lang, count=None):
  with gzip.open(os.path.join(MULTI30K, f'{split}.{lang}.gz'), 'rt',
                 encoding='utf-8') as f:
    lines = f.read().splitlines()
  return lines[:count] if count else lines


def _built_once(tmp_path_factory, name: str, build):
  """tmp/name, made by build(directory) once per test session.

  Under pytest-xdist each worker has its own session: the first to get here
  builds under a lock in the folder the workers share, the others wait and
  use what it built.
  """
  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent
  directory = root / name
  with open(root / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (directory / '.built').exists():
      shutil.rmtree(directory, ignore_errors=True)
      directory.mkdir()
      build(directory)
      (directory / '.built').touch()
  return directory


def _write_data_slice(directory):
  for split, count in (('train', 300), ('val', 30), ('test_2016_flickr', 30)):
    for lang in ('de', 'en'):
      lines = multi30k_lines(split, lang, count)
      if split == 'train':
        lines += ['', ' '.join(['Wort'] * 200)]
      text = '\n'.join(lines) + '\n'
      if split == 'val':
        (directory / f'{split}.{lang}').write_text(text, encoding='utf-8')
      else:
        with gzip.open(directory / f'{split}.{lang}.gz', 'wt',
                       encoding='utf-8') as f:
          f.write(text)


@pytest.fixture(scope='session')
def data_slice(tmp_path_factory):
  """300 training pairs (plus an empty and an overlong one), 30 val, 30 test.

  Written half gzipped, half plain, as the builder reads both.
  """
  if not os.path.isdir(MULTI30K):
    pytest.skip(f'Multi30k is not at {MULTI30K}')
  return _built_once(tmp_path_factory, 'slice', _write_data_slice)


def tiny_translation_config():
  """The translate preset shrunk to train 12 steps on data_slice in seconds.

  It saves two checkpoints and asks to average three, as a run its time
  budget ended early: it averages the two it has. Its eval_alpha is not the
  translate command's usual 0.6, so that the command's default shows whose
  it is.
  """
  return get_config('translate').replace(
      src_vocab_size=300, tgt_vocab_size=300, d_model=32, d_ff=64,
      num_heads=4, num_encoder_layers=1, num_decoder_layers=1, max_len=48,
      tokens_per_batch=1536, warmup_steps=10, train_steps=12, log_every=6,
      eval_every=12, checkpoint_every=6, eval_beam_size=2, average_last=3,
      eval_alpha=0.8)


def tiny_translation_flags(**changes) -> list[str]:
  """train.py's flags for tiny_translation_config().replace(**changes)."""
  config = tiny_translation_config().replace(**changes)
  preset = get_config('translate')
  return ['--task=translate', '--config=translate'] + [
      f'--{field.name}={getattr(config, field.name)}'
      for field in dataclasses.fields(config)
      if getattr(config, field.name) != getattr(preset, field.name)]


@pytest.fixture(scope='session')
def tiny_run(data_slice, tmp_path_factory):
  """A finished tiny translation run on data_slice: (workdir, results).

  Shared by every test (and worker) of a session: read it, or copy it to
  change it.
  """
  from flaxformer_mini.tasks import train_translation  # pylint: disable=g-import-not-at-top
  workdir = _built_once(
      tmp_path_factory, 'tiny_run', lambda directory: train_translation.run(
          tiny_translation_config(), str(directory / 'run'),
          data_dir=str(data_slice))) / 'run'
  return workdir, json.loads((workdir / 'results.json').read_text())


@pytest.fixture(scope='session')
def toy_config():
  return get_config('toy')


@pytest.fixture(scope='session')
def toy_batch(toy_config):
  """The tour's batch: 2 pairs, source length 3 (item 1 padded), target 2."""
  from flaxformer_mini import tour  # pylint: disable=g-import-not-at-top
  return tour.example_batch(toy_config)


@pytest.fixture(scope='module')
def toy_model(toy_config):
  """A toy-sized model with 9 tokens and 4 source sentences, one padded.

  Returns (config, params, src int32[4, 5]).
  """
  cfg = toy_config.replace(d_model=16, num_heads=4, d_ff=32, src_vocab_size=9,
                           tgt_vocab_size=9)
  params = init_params(cfg, jax.random.key(11))
  src = np.random.default_rng(4).integers(3, cfg.src_vocab_size, size=(4, 5))
  src[3, 2:] = cfg.pad_id
  return cfg, params, jnp.asarray(src, jnp.int32)


@pytest.fixture(scope='session')
def toy_params(toy_config):
  return init_params(toy_config, jax.random.key(0))


def _score_and_stop(exact_match):
  return exact_match, exact_match == 1.0


def _train_copy_model(cfg):
  """Trains on the copy task until a fresh draw is copied exactly.

  Returns (state, history, exact_match(params, draw=...) -> (match, sources,
  decoded)).
  """
  init_rng, dropout_rng = jax.random.split(jax.random.key(cfg.seed))
  decode_fn = train_copy.greedy_copier(cfg)
  draws = iter(range(1, 1000))
  parallel = DataParallel(cfg)
  state, history = loop.train(
      cfg, create_train_state(cfg, init_rng), dropout_rng,
      functools.partial(copy_task.train_batch, cfg),
      lambda s: _score_and_stop(train_copy.exact_match(
          s.params, cfg, decode_fn, next(draws), parallel)[0]),
      parallel)
  return state, history, functools.partial(
      train_copy.exact_match, config=cfg, decode_fn=decode_fn, parallel=parallel)


@pytest.fixture(scope='session')
def small_copy_config():
  """The copy preset on shorter sequences: trains in a few seconds."""
  return get_config('copy').replace(copy_length=6, batch_size=64,
                                    train_steps=1500, log_every=100)


@pytest.fixture(scope='session')
def train_copy_model():
  """The function cfg -> (state, history, exact_match(params, draw=...)),
  trained once per cfg in a session."""
  return functools.cache(_train_copy_model)
