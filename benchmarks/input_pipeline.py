"""What the input pipeline costs as the corpus grows, with the accelerator out
of the picture.

  python benchmarks/input_pipeline.py CORPUS [CORPUS ...] [--workdirs DIR]
      [--config wmt14] [--steps 200]

CORPUS: folders in the local layout (benchmarks/synthetic_corpus.py writes
them at any size). For each one:

  * first start: `train.py --task=translate` (a one-layer model of d_model 32,
    so that training costs nothing next to the data; one step) in a child
    process on a fresh workdir: its wall time and `seconds_to_first_step`
    (preparation: fingerprinting, TFDS, the vocabulary on its sample, the
    tokenization; then the compile), and its peak resident memory;
  * second start: the same command one step further (a resume): the time to
    its first step and its peak resident memory;
  * input throughput: the run's batches (`TokenBatches` over the tokenized
    training split under the --config's token budget, the training loop's
    `prefetched`), real target tokens per second, with one thread and with
    the loop's threads;
  * the host loop's ceiling: `loop.train` on those batches with a step that
    costs nearly nothing (steps per second: no accelerator can run the loop
    faster), and the share of a real step (the one-layer model, on this
    CPU) spent waiting on the host: 1 - (time on batches made in advance) /
    (time on batches made by the pipeline).

Prints one JSON object with a record per corpus.
"""

import argparse
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini import loop
from flaxformer_mini.config import get_config
from flaxformer_mini.data import batching, prefetch, tokenized
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.training import create_train_state

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The child runs' model: one layer each side, d_model 32, and their batches.
SMALL_MODEL = dict(num_encoder_layers=1, num_decoder_layers=1, d_model=32,
                   d_ff=64, num_heads=2)
CHILD_DATA = dict(tokens_per_batch=4096, max_len=128)


# Runs train.py and writes its peak resident memory (VmHWM, Linux) to argv[1]
# at exit: the child's own, whereas getrusage counts the parent's memory at
# the fork as well.
_PEAK_MEMORY = """
import atexit, runpy, sys
out = sys.argv[1]
def peak():
  with open('/proc/self/status') as f:
    kb = next(int(line.split()[1]) for line in f if line.startswith('VmHWM'))
  with open(out, 'w') as f:
    f.write(str(kb))
atexit.register(peak)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def _child(flags: list[str]) -> dict:
  """Runs train.py in a child: its wall seconds, peak RSS and results.json."""
  workdir = next(f.split('=', 1)[1] for f in flags
                 if f.startswith('--workdir='))
  peak = workdir + '.peak_kb'
  start = time.perf_counter()
  child = subprocess.run(
      [sys.executable, '-c', _PEAK_MEMORY, peak,
       os.path.join(ROOT, 'train.py'), *flags],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  wall = time.perf_counter() - start
  if child.returncode:
    sys.exit(f'train.py {" ".join(flags)} failed ({child.returncode}):\n'
             f'{child.stdout[-3000:]}')
  with open(os.path.join(workdir, 'results.json')) as f:
    results = json.load(f)
  with open(peak) as f:
    peak_mb = int(f.read()) / 1024
  return {'wall_s': wall, 'peak_rss_mb': peak_mb,
          'seconds_to_first_step': results['seconds_to_first_step']}


def _starts(corpus: str, workdir: str, config_name: str,
            vocab_size: int) -> dict:
  flags = ['--task=translate', f'--config={config_name}',
           f'--data_dir={corpus}', f'--workdir={workdir}', '--log_every=1',
           '--eval_every=1000', '--average_last=0', '--eval_beam_size=1',
           '--compilation_cache=', '--vocab_sample=0',  # all, up to 1M
           f'--src_vocab_size={vocab_size}', f'--tgt_vocab_size={vocab_size}',
           ] + [f'--{name}={value}' for name, value in
                {**SMALL_MODEL, **CHILD_DATA}.items()]
  first = _child(flags + ['--train_steps=1'])
  second = _child(flags + ['--train_steps=2'])
  return {'first_start': first, 'second_start': second}


def _throughput(train: tokenized.TokenizedSplit, config, steps: int,
                threads: int) -> dict:
  batches = batching.TokenBatches(train, config, config.tokens_per_batch)
  for step in range(steps):  # the batches' pages in memory, as in a run
    batches.batch_at(step)
  made = prefetch.prefetched(batches.batch_at, 0, steps, threads)
  start, tokens = time.perf_counter(), 0
  for batch in made:
    tokens += int(batch.ntokens)
  seconds = time.perf_counter() - start
  made.close()
  return {'threads': threads, 'target_tokens_per_s': tokens / seconds,
          'batches_per_s': steps / seconds}


def _padding(train: tokenized.TokenizedSplit, config, batches: int) -> dict:
  """Padding and compiled shapes: the length buckets against packing.

  Bucketing: the share of pad among the positions of the first `batches`
  batches of an epoch (both sides), and the shapes of the whole epoch.
  Packing, simulated on the same pairs: each side laid end to end into rows
  of max_len (next fit: a sentence that does not fit in the current row
  starts the next), one shape, pad only at the ends of rows (the model would
  also need attention masks and positions per packed sentence).
  """
  buckets = batching.TokenBatches(train, config, config.tokens_per_batch)
  plan = buckets.epoch_batches()[:batches]
  lengths = train.lengths()[np.concatenate([rows for _, rows in plan])] + 1
  positions = sum(2 * length * buckets.rows_of(length) for length, _ in plan)
  packed_rows = 0
  for side in (0, 1):
    room = 0
    for length in lengths[:, side]:
      if length > room:
        packed_rows, room = packed_rows + 1, config.max_len
      room -= length
  return {'bucketed': {'padding': 1 - lengths.sum() / positions,
                       'shapes': len(buckets.shapes())},
          'packed': {'padding': 1 - lengths.sum() / (packed_rows *
                                                     config.max_len),
                     'shapes': 1}}


class _First:
  """The first `count` records of a data source."""

  def __init__(self, source, count: int):
    self.source, self.count = source, count

  def __len__(self) -> int:
    return self.count

  def __getitems__(self, indices):
    return self.source.__getitems__(indices)


def _on_the_fly(workdir: str, config, pairs: int) -> dict:
  """Tokenizing inside the pipeline instead: SentencePiece (all threads) on
  the prepared TFDS records, pairs and target tokens per second."""
  # pylint: disable=g-import-not-at-top
  import glob
  import tensorflow_datasets as tfds
  from flaxformer_mini.data import tokenizer as spm_lib
  folder = glob.glob(os.path.join(workdir, 'tfds', '*', '*', '*'))[0]
  source = tfds.builder_from_directory(folder).as_data_source()['train']
  model = spm_lib.load_tokenizer(os.path.join(workdir, 'spm'))
  count = min(pairs, len(source))
  start, tokens = time.perf_counter(), 0
  for _, tgt in tokenized.encoded_chunks(
      _First(source, count), (config.src_lang, config.tgt_lang), model):
    tokens += sum(map(len, tgt))
  seconds = time.perf_counter() - start
  return {'pairs_per_s': count / seconds,
          'target_tokens_per_s': tokens / seconds}


class _FreeStep(DataParallel):
  """DataParallel whose training step does (almost) nothing."""

  @functools.cached_property
  def train_step(self):
    def step(state, batch, rng):
      del rng
      ntokens = jnp.sum(batch.ntokens)
      return state, {'loss_sum': jnp.float32(0), 'ntokens': ntokens,
                     'correct': ntokens, 'learning_rate': jnp.float32(0)}
    return jax.jit(step, donate_argnums=0)


def _loop_seconds(config, parallel, batch_at, steps: int) -> float:
  """Seconds of `loop.train` over steps 0..steps-1, every shape compiled."""
  config = config.replace(train_steps=steps, log_every=steps,
                          eval_every=10 * steps)

  def run():
    state = create_train_state(config, jax.random.key(0))
    start = time.perf_counter()
    loop.train(config, state, jax.random.key(1), batch_at, parallel=parallel)
    return time.perf_counter() - start

  run()  # compiles the step for every batch shape
  return run()


def _host_loop(train: tokenized.TokenizedSplit, config, steps: int,
               vocab_size: int) -> dict:
  """The loop's ceiling on `config`'s batches; the host's share of a real
  step: the child runs' model and batches (a step of milliseconds here)."""
  batches = batching.TokenBatches(train, config, config.tokens_per_batch)
  # The free step carries the small model's state: a large one would be
  # copied through the step, a cost of the update, not of the loop.
  free = _loop_seconds(config.replace(**SMALL_MODEL),
                       _FreeStep(config.replace(**SMALL_MODEL)),
                       batches.batch_at, steps)
  small = config.replace(**SMALL_MODEL, **CHILD_DATA, dropout_rate=0.0,
                         src_vocab_size=vocab_size, tgt_vocab_size=vocab_size)
  batches = batching.TokenBatches(train, small, small.tokens_per_batch)
  # A real step, fed by the pipeline, then by batches made in advance.
  parallel = DataParallel(small)
  real_steps = min(steps, 40)  # a real step takes a good part of a second
  fed = _loop_seconds(small, parallel, batches.batch_at, real_steps)
  ready = [batches.batch_at(step) for step in range(real_steps)]
  in_advance = _loop_seconds(small, parallel, ready.__getitem__, real_steps)
  return {'ceiling_steps_per_s': steps / free,
          'real_step_s': in_advance / real_steps,
          'host_wait_share': max(0.0, 1 - in_advance / fed)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('corpora', nargs='+')
  parser.add_argument('--workdirs', help='keep the runs here (default: a '
                      'temporary folder, deleted after)')
  parser.add_argument('--config', default='wmt14',
                      help="the preset whose vocabulary, sample and token "
                      "budget are measured (default: the paper's, wmt14)")
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--vocab_size', type=int, default=10000,
                      help="the child runs' vocabulary (Multi30k's sentences "
                      'make no more pieces)')
  args = parser.parse_args()
  root = args.workdirs or tempfile.mkdtemp()
  config = get_config(args.config)
  records = []
  try:
    for corpus in args.corpora:
      workdir = os.path.join(root, os.path.basename(os.path.abspath(corpus)))
      shutil.rmtree(workdir, ignore_errors=True)
      starts = _starts(corpus, workdir, args.config, args.vocab_size)
      train = tokenized.TokenizedSplit(os.path.join(workdir, 'tokens'),
                                       'train')
      records.append({
          'corpus': corpus, 'pairs': len(train), **starts,
          'input': [_throughput(train, config, args.steps, threads)
                    for threads in (1, 2)],
          'tokenizing_on_the_fly': _on_the_fly(workdir, config, 100_000),
          'padding': _padding(train, config, args.steps),
          'host_loop': _host_loop(train, config, args.steps,
                                  args.vocab_size)})
  finally:
    if not args.workdirs:
      shutil.rmtree(root, ignore_errors=True)
  common.emit({'benchmark': 'input_pipeline', 'config': args.config,
               'tokens_per_batch': config.tokens_per_batch,
               'child_vocab_size': args.vocab_size,
               'config_fields': dataclasses.asdict(config),
               'corpora': records})


if __name__ == '__main__':
  main()
