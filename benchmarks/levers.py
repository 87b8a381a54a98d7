"""What each speed lever buys: every one measured on and off, in one process.

  python benchmarks/levers.py [--config small]
  python benchmarks/levers.py --only cpu_kernels donated_state

Each lever is timed against its alternative on the same inputs, the two
interleaved, and reported as `speedup` = time without the lever / time with
it. Each time is the best of --repeats runs: the work is deterministic, so
the fastest run is the one least disturbed by the rest of a shared machine.

- cpu_kernels: the training step (batch 64 x 32 on `small`, 16 x 64 on
  `base`) with config.cpu_kernels (cpu_kernels.py: every nn.Dense's weight
  gradient and the tied output layer's gradient in the CPU's fast operand
  layout), against the plain model. An option, for CPU runs.
- cross_attention_kv: decoding projects the encoder output through W^K, W^V
  once (decoding.project_cross_kv) instead of at every step. Greedy search,
  batch 32, 32 tokens.
- closed_form_loss: the label-smoothed KL from log-probabilities, against
  materialising the smoothed one-hot target [batch, len, vocab]; loss +
  gradient w.r.t. the logits.
- donated_state: the training step donates its input state (buffers reused
  in place), against a step that does not. The JSON adds `memory_mb`, what
  XLA's buffer assignment gives each compiled step to hold at once.
- keep_freed_memory: the training step in a process started with
  common.KEEP_FREED_MEMORY in GLIBC_TUNABLES (glibc keeps the step's freed
  host buffers for the next step), against glibc's defaults, which fault the
  step's temporaries in again at every step (separate processes).
- compilation_cache: `train.py --task=copy` wall time with a warm persistent
  compilation cache against a cold one (separate processes).
- metrics_on_device: the copy task's training loop (50 steps of its preset)
  keeping each step's metrics on the device and fetching them all at the
  end, as loop.train does at every log, against fetching every step's
  metrics as it ends.
- batches_during_step: the same loop making and placing each batch while the
  step before it runs (JAX's asynchronous dispatch), against waiting for each
  step to finish first.
- bounded_shapes: one epoch of Multi30k de-en (the translate preset's
  vocabulary and budget) in length buckets (data.batching.TokenBatches),
  against as many batches of shuffled sentences, each padded to its own
  longest pair: the compile seconds of the epoch's distinct batch shapes,
  their count times the median time to compile the step at three bucket
  shapes; the JSON adds the shape counts and padded tokens. Needs the
  Multi30k files (--data_dir); not run without them.
"""

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini import losses
from flaxformer_mini.config import get_config
from flaxformer_mini.data import batching, copy_task, parallel_text
from flaxformer_mini.data.lines import read_lines
from flaxformer_mini.data import tokenizer as spm_lib
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.training import create_train_state, train_step

import common
import decode as decode_bench
import train_step as train_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where CI keeps the real data: ../shared/data/multi30k beside the project.
MULTI30K = os.path.join(os.path.dirname(ROOT), 'shared', 'data', 'multi30k')


def compare(with_lever, without_lever, repeats: int) -> dict:
  """Interleaved best-of-`repeats` times of two blocking callables."""
  runs = {'with': with_lever, 'without': without_lever}
  common.interleaved_seconds(runs, 1)  # warm-up
  times = common.interleaved_seconds(runs, repeats)
  with_s, without_s = (min(times[k]) for k in ('with', 'without'))
  return {'with_s': with_s, 'without_s': without_s,
          'speedup': without_s / with_s}


def _one_batch(config_name: str, config):
  """train_step.py's batch of config_name -> (config at that batch, batch)."""
  batch, length = train_bench.SHAPES[config_name]
  config = config.replace(batch_size=batch)
  return config, train_bench.synthetic_batches(config, batch, length, 'full',
                                               1)[0]


def _blocking_train_step(config, batch, rng):
  """The donated training step of `config`, compiled for `batch`.

  -> a call that makes one step and waits for it.
  """
  state = create_train_state(config, jax.random.key(0))
  step = jax.jit(functools.partial(train_step, config=config),
                 donate_argnums=0)
  compiled, compile_s = train_bench.compile_timed(step, state, batch, rng)
  return train_bench.blocking_run(compiled, state, [batch], rng,
                                  compile_s)['advance']


def cpu_kernels(config_name: str, repeats: int) -> dict:
  config, host = _one_batch(config_name,
                            get_config(config_name).replace(dropout_rate=0.1))
  rng = jax.random.key(1)
  return compare(_blocking_train_step(config.replace(cpu_kernels=True), host,
                                      rng),
                 _blocking_train_step(config, host, rng), repeats)


def cross_attention_kv(config, repeats):
  params, src = decode_bench.random_model_and_sources(config)
  once, every_step = (jax.jit(functools.partial(
      decode_bench.decode_without_eos, config=config, beam_size=1, gen_len=32,
      cross_kv_once=flag)) for flag in (True, False))
  np.testing.assert_array_equal(once(params, src), every_step(params, src))
  return compare(lambda: once(params, src).block_until_ready(),
                 lambda: every_step(params, src).block_until_ready(), repeats)


def closed_form_loss(config, repeats):
  vocab = config.tgt_vocab_size
  logits = jax.random.normal(jax.random.key(0), (64, 32, vocab))
  labels = jax.random.randint(jax.random.key(1), (64, 32), 3, vocab)
  eps = 0.1

  def materialised(logits):
    q = losses.smoothed_targets(labels, vocab, eps, config.pad_id)
    log_p = jax.nn.log_softmax(logits)
    return jnp.sum(jnp.where(q > 0, q * (jnp.log(jnp.where(q > 0, q, 1.0)) -
                                         log_p), 0.0))

  def closed_form(logits):
    return losses.label_smoothed_kl(logits, labels, eps, config.pad_id)[0]

  on, off = (jax.jit(jax.value_and_grad(f)) for f in (closed_form,
                                                      materialised))
  np.testing.assert_allclose(on(logits)[0], off(logits)[0], rtol=1e-4)
  return compare(lambda: jax.block_until_ready(on(logits)),
                 lambda: jax.block_until_ready(off(logits)), repeats)


def donated_state(config, repeats):
  config, host = _one_batch('small', config)
  rng = jax.random.key(1)
  step = functools.partial(train_step, config=config)
  jitted = {'with': jax.jit(step, donate_argnums=0), 'without': jax.jit(step)}
  # Each run gets its own state: the donating step consumes what it is given.
  donating, copying = (
      train_bench.blocking_run(jitted[name], create_train_state(
          config, jax.random.key(0)), [host], rng, compile_s=None)['advance']
      for name in ('with', 'without'))
  shapes = jax.eval_shape(functools.partial(create_train_state, config),
                          jax.random.key(0))
  return {**compare(donating, copying, repeats),
          'memory_mb': {name: _held_mb(run.lower(shapes, host, rng).compile())
                        for name, run in jitted.items()}}


def _held_mb(compiled) -> float:
  """MiB a compiled program's buffers take at once, by XLA's assignment."""
  memory = compiled.memory_analysis()
  held = (memory.argument_size_in_bytes + memory.output_size_in_bytes -
          memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  return held / 2**20


# Best-of-`repeats` training-step seconds in a fresh process (argv: config
# name, batch, length, repeats); its malloc is whatever GLIBC_TUNABLES says.
_STEP_IN_A_PROCESS = """
import functools, sys, time
import jax, numpy as np
from flaxformer_mini.config import get_config
from flaxformer_mini.masks import make_batch
from flaxformer_mini.training import create_train_state, train_step
batch, length = int(sys.argv[2]), int(sys.argv[3])
config = get_config(sys.argv[1]).replace(batch_size=batch, dropout_rate=0.1)
ids = np.random.default_rng(0).integers(
    3, config.src_vocab_size, (batch, length + 1)).astype(np.int32)
ids[:, 0] = config.bos_id
batch = make_batch(ids[:, 1:], ids, config)
step = jax.jit(functools.partial(train_step, config=config), donate_argnums=0)
state, rng = create_train_state(config, jax.random.key(0)), jax.random.key(1)
times = []
for _ in range(int(sys.argv[4]) + 1):
  start = time.perf_counter()
  state, metrics = step(state, batch, rng)
  jax.block_until_ready((state, metrics))
  times.append(time.perf_counter() - start)
print(min(times[1:]))
"""


def keep_freed_memory(config_name: str, repeats: int) -> dict:
  def best_step_s(tunables: str | None):
    env = {k: v for k, v in os.environ.items() if k != 'GLIBC_TUNABLES'}
    if tunables:
      env['GLIBC_TUNABLES'] = tunables
    done = subprocess.run(
        [sys.executable, '-c', _STEP_IN_A_PROCESS, config_name,
         *map(str, train_bench.SHAPES[config_name]), str(repeats)],
        check=True, capture_output=True, text=True, env=env)
    return float(done.stdout.split()[-1])

  with_s = best_step_s(common.KEEP_FREED_MEMORY)
  without_s = best_step_s(None)
  return {'with_s': with_s, 'without_s': without_s,
          'speedup': without_s / with_s}


def compilation_cache(repeats):
  del repeats  # two whole training runs: one each
  with tempfile.TemporaryDirectory() as cache_dir:

    def copy_run():
      with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'),
                        '--task=copy', f'--workdir={workdir}',
                        f'--compilation_cache={cache_dir}'], check=True,
                       capture_output=True)
        return time.perf_counter() - start

    cold = copy_run()
    warm = copy_run()
  return {'with_s': warm, 'without_s': cold, 'speedup': cold / warm}


def _copy_training_loop(steps: int, wait: str):
  """A blocking run of `steps` copy-task training steps, made as in
  loop.train: each step dispatched with its batch, metrics kept.

  wait: what follows each dispatch: 'nothing' (every step's metrics fetched
  at the end, as at a log), 'fetch' (the step's metrics fetched at once) or
  'block' (the step waited for; metrics fetched at the end).
  """
  config = get_config('copy')
  parallel = DataParallel(config)
  rng = jax.random.key(1)
  first = parallel.replicate(create_train_state(config, jax.random.key(0)))

  def run():
    state = jax.tree.map(jnp.copy, first)  # the step donates what it gets
    pending = []
    for step in range(steps):
      state, metrics = parallel.train_step(
          state, parallel.put_batch(copy_task.train_batch(config, step)), rng)
      if wait == 'fetch':
        metrics = parallel.to_host(metrics)
      elif wait == 'block':
        jax.block_until_ready(state)
      pending.append(metrics)
    if wait != 'fetch':
      pending = [parallel.to_host(m) for m in pending]
    jax.block_until_ready(state)
  return run


def metrics_on_device(repeats: int) -> dict:
  return compare(_copy_training_loop(50, 'nothing'),
                 _copy_training_loop(50, 'fetch'), repeats)


def batches_during_step(repeats: int) -> dict:
  return compare(_copy_training_loop(50, 'nothing'),
                 _copy_training_loop(50, 'block'), repeats)


def _multi30k_train_pairs(data_dir: str, config) -> batching.Pairs:
  """Multi30k's de-en training pairs as ids of a vocabulary trained here
  (those that TokenBatches keeps: not empty, within max_len)."""
  paths = parallel_text.local_split_files(
      data_dir, (config.src_lang, config.tgt_lang))['train']

  src, tgt = (list(read_lines(path)) for path in paths)
  with tempfile.TemporaryDirectory() as vocab_dir:
    tokenizer = spm_lib.train_tokenizer(src + tgt,
                                        os.path.join(vocab_dir, 'spm'), config)
  encode = lambda texts: [np.asarray(ids, np.int32)
                          for ids in tokenizer.encode(texts)]
  kept = [(s, t) for s, t in zip(encode(src), encode(tgt))
          if 0 < len(s) < config.max_len and 0 < len(t) < config.max_len]
  return batching.Pairs([s for s, _ in kept], [t for _, t in kept])


def bounded_shapes(data_dir: str) -> dict:
  if not os.path.isdir(data_dir):
    return {'not_run': f'--data_dir={data_dir}: no such directory (the '
                       'Multi30k task-1 raw files)'}
  config = get_config('translate')
  pairs = _multi30k_train_pairs(data_dir, config)
  buckets = batching.TokenBatches(pairs, config, config.tokens_per_batch)
  plan = buckets.epoch_batches()
  # One batch's sentences of each bucket length, to compile.
  bucketed = dict(plan)
  # The alternative: as many batches, of as many sentences each, in random
  # order, each padded to its own longest pair (+ eos, as TokenBatches).
  lengths = np.array([max(len(s), len(t)) + 1
                      for s, t in zip(pairs.src, pairs.tgt)])
  rows = -(-len(lengths) // len(plan))
  order = np.random.default_rng(config.seed).permutation(len(lengths))
  own = [(len(group), int(lengths[group].max()))
         for group in np.array_split(order, range(rows, len(order), rows))]

  parallel = DataParallel(config)
  state = parallel.replicate(create_train_state(config, jax.random.key(0)))
  compile_s = []
  for length in sorted(bucketed)[::max(1, len(bucketed) // 2)][:3]:
    batch = parallel.put_batch(buckets.make(bucketed[length], length,
                                            buckets.rows_of(length)))
    start = time.perf_counter()
    parallel.train_step.lower(state, batch, jax.random.key(1)).compile()
    compile_s.append(time.perf_counter() - start)
  per_shape = float(np.median(compile_s))
  shapes = {'with': len(buckets.shapes()), 'without': len(set(own))}
  return {'with_s': shapes['with'] * per_shape,
          'without_s': shapes['without'] * per_shape,
          'speedup': shapes['without'] / shapes['with'],
          'compile_s_per_shape': per_shape, 'shapes': shapes,
          'real_tokens': int(lengths.sum()),
          'padded_tokens': {
              'with': sum(buckets.rows_of(length) * length
                          for length, _ in plan),
              'without': sum(n * length for n, length in own)}}


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='small', choices=['small', 'base'])
  parser.add_argument('--repeats', type=int, default=15)
  parser.add_argument('--data_dir', default=MULTI30K,
                      help='Multi30k task-1 raw files, for bounded_shapes')
  parser.add_argument('--only', nargs='+', metavar='LEVER',
                      help='measure these levers alone (names as in the '
                      'list above)')
  args = parser.parse_args()
  config = get_config(args.config).replace(dropout_rate=0.1, max_len=64)
  # Whole training steps and loops take longer per run: fewer repeats.
  few = max(3, args.repeats // 3)
  levers = {
      'cpu_kernels': (lambda: cpu_kernels(args.config, few), 'option'),
      'cross_attention_kv':
          (lambda: cross_attention_kv(config, args.repeats), True),
      'closed_form_loss': (lambda: closed_form_loss(config, args.repeats),
                           True),
      'donated_state': (lambda: donated_state(config, args.repeats), True),
      'keep_freed_memory':
          (lambda: keep_freed_memory(args.config, args.repeats), 'option'),
      'compilation_cache': (lambda: compilation_cache(args.repeats), True),
      'metrics_on_device': (lambda: metrics_on_device(few), True),
      'batches_during_step': (lambda: batches_during_step(few), True),
      'bounded_shapes': (lambda: bounded_shapes(args.data_dir), True),
  }
  unknown = sorted(set(args.only or ()) - set(levers))
  if unknown:
    parser.error(f"--only {' '.join(unknown)}: no such lever; the levers "
                 f"are {', '.join(levers)}.")
  results = {name: {**measure(), 'kept': kept}
             for name, (measure, kept) in levers.items()
             if not args.only or name in args.only}
  common.emit({'benchmark': 'levers', 'config': args.config,
               'levers': results})


if __name__ == '__main__':
  main()
