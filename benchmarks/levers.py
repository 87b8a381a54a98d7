"""What each speed lever buys: every one measured on and off, in one process.

  python benchmarks/levers.py [--config small]
  python benchmarks/levers.py --only donated_state metrics_on_device

Each lever is timed against its alternative on the same inputs, the two
interleaved, and reported as `speedup` = time without the lever / time with
it. Each time is the best of --repeats runs: the work is deterministic, so
the fastest run is the one least disturbed by the rest of a shared machine.
Differences within about 10 % are not measurable that way. Levers the
project keeps are marked `kept`; the two-stage top-k and the fused QKV
projection are measured and not kept (they lose on CPU); scan_layers and
fused_attention are options, off by default (`kept` says 'option').

- cross_attention_memory: decoding projects the encoder output through W^K,
  W^V once (decoding.project_memory) instead of at every step. Greedy search,
  batch 32, 32 tokens.
- beams_share_memory: beam search (beam 4, batch 32, 32 tokens, eos
  impossible) with the encoder's cross-attention keys and values kept once
  per sentence and shared by its beams (attention_shared_by_groups), against
  the encoder output copied to every beam before they are projected.
- table_major_logits: greedy decoding of the `base` model (batch 32, 32
  tokens, whatever --config) with the tied output projection of its 32 rows
  computed as table @ x^T (embeddings.tied_logits), against x @ table.T
  (embeddings.FEW_ROWS set to 0 while that search is traced).
- two_stage_top_k: beam search's top 2k of beam x vocab as a top-k per beam
  then over beams, against one top-k over beam x vocab. [32, 4, vocab].
- two_reduction_argmax: greedy search's next token as a max and then a min
  over the indices that reach it (decoding._argmax), against jnp.argmax's
  (value, index) reduction. [32, vocab].
- closed_form_loss: the label-smoothed KL from log-probabilities, against
  materialising the smoothed one-hot target [batch, len, vocab]; loss +
  gradient w.r.t. the logits.
- tied_logits_vjp: the tied output projection's gradient written out
  (embeddings.tied_logits), against autodiff's, whose table gradient makes
  XLA's CPU backend transpose the whole [tokens, vocab] gradient; gradient of
  projection + loss w.r.t. both inputs.
- dense_weight_gradient: the training step (batch 64 x 32 on `small`, 16 x
  64 on `base`) with every nn.Dense's weight gradient written out
  (linear.dot_general: x^T copied before the product), against autodiff's
  product contracted over the tokens (jax.lax.dot_general while the step is
  traced).
- donated_state: the training step donates its input state (buffers reused
  in place), against a step that does not. The JSON adds `memory_mb`, what
  XLA's buffer assignment gives each compiled step to hold at once:
  arguments + outputs - the outputs written into donated arguments +
  temporaries.
- fused_attention: the training step (batch 64 x 32, the --config model)
  with attention through jax.nn.dot_product_attention
  (config.attention_implementation='xla', an option; 'cudnn' needs a GPU)
  against the explicit products, softmax and masks.
- fused_qkv: one [d, 3d] projection instead of three [d, d] (forward +
  backward on [batch * len, d]).
- scan_layers_compile, scan_layers_step: the `base` training step
  (16 x 64, whatever --config) with its layers as one nn.scan each
  (config.scan_layers, an option) against unrolled: compile seconds, then
  step seconds.
- compilation_cache: `train.py --task=copy` wall time with a warm persistent
  compilation cache against a cold one (separate processes).
- metrics_on_device: the copy task's training loop (its preset's real
  step, 50 steps) keeping each step's metrics on the device and fetching them
  all at the end, as experiment.train does at every log, against fetching
  every step's metrics as it ends (the host then waits for each step before
  it makes the next batch).
- batches_during_step: the same loop making and placing each batch while the
  step before it runs (JAX's asynchronous dispatch), against waiting for each
  step to finish first; metrics stay on the device in both.
- bounded_shapes: one epoch of Multi30k de-en under the translate preset (a
  SentencePiece vocabulary trained here, as train.py trains it) in length
  buckets (data.batching.TokenBatches), against the same sentences shuffled
  into batches of as many sentences each, every batch padded to its own
  longest pair: the compile seconds of the epoch's distinct batch shapes,
  their count times the median time to compile the translate step at three
  of the bucket shapes. The JSON adds the shape counts and the padded tokens
  of both. Needs the Multi30k files (--data_dir); not run without them.
- keep_freed_memory: the training step (batch 64 x 32 on `small`, 16 x 64 on
  `base`) in a process whose malloc keeps freed memory for reuse
  (host_memory.keep_freed_memory, as train.py and these benchmarks run),
  against one with glibc's defaults, which page-fault the step's temporaries
  in at every step (separate processes, one after the other).
"""

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini import decoding, embeddings, linear, losses
from flaxformer_mini.config import get_config
from flaxformer_mini.data import batching, copy_task, parallel_text
from flaxformer_mini.data import tokenizer as spm_lib
from flaxformer_mini.masks import padding_mask
from flaxformer_mini.model import Transformer
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


def cross_attention_memory(config, repeats):
  params, src = decode_bench.random_model_and_sources(config)
  model = Transformer(config)

  def greedy(params, src, use_memory):
    src_mask = padding_mask(src, config.pad_id)
    encoded = model.apply({'params': params}, src, src_mask,
                          method=Transformer.encode)
    extra = ({'memory': decoding.project_memory(params, config, encoded,
                                                src_mask)}
             if use_memory else {})

    def step(tokens, cache):
      logits, variables = model.apply(
          {'params': params, 'cache': cache, **extra}, encoded, src_mask,
          tokens, decode=True, mutable=['cache'], method=Transformer.decode)
      return logits[:, -1].at[:, config.eos_id].set(-jnp.inf), variables[
          'cache']

    return decoding.greedy_search(
        step, decoding.init_cache(config, encoded, src_mask, 32), 32, 32,
        config.bos_id, config.eos_id, config.pad_id)

  on, off = (jax.jit(functools.partial(greedy, use_memory=flag))
             for flag in (True, False))
  return compare(lambda: on(params, src).block_until_ready(),
                 lambda: off(params, src).block_until_ready(), repeats)


def beams_share_memory(config, repeats):
  params, src = decode_bench.random_model_and_sources(config)
  on, off = (jax.jit(functools.partial(
      decode_bench.decode_without_eos, config=config, beam_size=4, gen_len=32,
      beams_share_memory=flag)) for flag in (True, False))
  np.testing.assert_array_equal(on(params, src), off(params, src))
  return compare(lambda: on(params, src).block_until_ready(),
                 lambda: off(params, src).block_until_ready(), repeats)


def table_major_logits(repeats):
  config = get_config('base').replace(dropout_rate=0.0)
  params, src = decode_bench.random_model_and_sources(config)

  def compiled_search(table_major: bool):
    jax.clear_caches()  # tied_logits' trace is cached apart from FEW_ROWS
    lowered = jax.jit(functools.partial(
        decode_bench.decode_without_eos, config=config, beam_size=1,
        gen_len=32)).lower(params, src)
    assert ('optimization_barrier' in lowered.as_text()) == table_major
    return lowered.compile()

  on = compiled_search(table_major=True)
  few_rows, embeddings.FEW_ROWS = embeddings.FEW_ROWS, 0
  try:
    off = compiled_search(table_major=False)
  finally:
    embeddings.FEW_ROWS = few_rows
    jax.clear_caches()
  np.testing.assert_array_equal(on(params, src), off(params, src))
  return compare(lambda: on(params, src).block_until_ready(),
                 lambda: off(params, src).block_until_ready(), repeats)


def two_stage_top_k(config, repeats):
  beams, vocab = 4, config.tgt_vocab_size
  candidates = jax.random.normal(jax.random.key(0), (32, beams, vocab))

  def one_stage(x):
    return jax.lax.top_k(x.reshape(32, beams * vocab), 2 * beams)

  def two_stages(x):
    values, tokens = jax.lax.top_k(x, 2 * beams)
    best, picks = jax.lax.top_k(values.reshape(32, -1), 2 * beams)
    return best, jnp.take_along_axis(tokens.reshape(32, -1), picks, 1)

  on, off = jax.jit(two_stages), jax.jit(one_stage)
  np.testing.assert_array_equal(on(candidates)[0], off(candidates)[0])
  return compare(lambda: jax.block_until_ready(on(candidates)),
                 lambda: jax.block_until_ready(off(candidates)),
                 repeats * 20)


def two_reduction_argmax(config, repeats):
  logits = jax.random.normal(jax.random.key(0), (32, config.tgt_vocab_size))
  on = jax.jit(decoding._argmax)  # pylint: disable=protected-access
  off = jax.jit(lambda x: jnp.argmax(x, axis=-1))
  np.testing.assert_array_equal(on(logits), off(logits))
  return compare(lambda: on(logits).block_until_ready(),
                 lambda: off(logits).block_until_ready(), repeats)


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


def tied_logits_vjp(config, repeats):
  x = jax.random.normal(jax.random.key(0), (64, 32, config.d_model))
  table = jax.random.normal(jax.random.key(1),
                            (config.tgt_vocab_size, config.d_model))
  labels = jax.random.randint(jax.random.key(2), (64, 32), 3,
                              config.tgt_vocab_size)

  def loss(project):
    return lambda x, table: losses.label_smoothed_kl(
        project(x, table), labels, 0.1, config.pad_id)[0]

  on, off = (jax.jit(jax.grad(loss(project), argnums=(0, 1))) for project in
             (embeddings.tied_logits,
              lambda x, table: jnp.einsum('btd,vd->btv', x, table)))
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-3,
                                 atol=1e-4), on(x, table), off(x, table))
  return compare(lambda: jax.block_until_ready(on(x, table)),
                 lambda: jax.block_until_ready(off(x, table)), repeats)


def _one_batch(config_name: str, config):
  """train_step.py's batch of config_name -> (config at that batch, batch)."""
  batch, length = train_bench.SHAPES[config_name]
  config = config.replace(batch_size=batch)
  return config, train_bench.synthetic_batches(config, batch, length, 'full',
                                               1)[0]


def _blocking_train_step(config, batch, rng, lowered_check=None):
  """The donated training step, compiled for `batch`.

  lowered_check, if given, is called with the lowered program's text.
  -> (a call that makes one step and waits for it, compile seconds).
  """
  state = create_train_state(config, jax.random.key(0))
  step = jax.jit(functools.partial(train_step, config=config),
                 donate_argnums=0)
  if lowered_check is not None:
    lowered_check(step.lower(state, batch, rng).as_text())
  compiled, compile_s = train_bench.compile_timed(step, state, batch, rng)
  return train_bench.blocking_run(compiled, state, [batch], rng,
                                  compile_s)['advance'], compile_s


def dense_weight_gradient(config_name: str, repeats: int) -> dict:
  config, host = _one_batch(config_name,
                            get_config(config_name).replace(dropout_rate=0.1))
  rng = jax.random.key(1)

  def blocking_step(autodiff: bool):
    jax.clear_caches()  # the model's trace is cached apart from the patch

    def patch_reached_the_step(text):
      assert ('optimization_barrier' in text) != autodiff

    with mock.patch.object(linear, 'dot_general',
                           jax.lax.dot_general if autodiff else
                           linear.dot_general):
      return _blocking_train_step(config, host, rng,
                                  patch_reached_the_step)[0]

  return compare(blocking_step(autodiff=False), blocking_step(autodiff=True),
                 repeats)


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


def fused_attention(config, repeats):
  config, host = _one_batch('small', config)
  rng = jax.random.key(1)
  fused, explicit = (
      _blocking_train_step(config.replace(attention_implementation=name),
                           host, rng)[0] for name in ('xla', 'explicit'))
  return compare(fused, explicit, repeats)


def fused_qkv(config, repeats):
  d = config.d_model
  x = jax.random.normal(jax.random.key(0), (64 * 32, d))
  kernels = [jax.random.normal(jax.random.key(i), (d, d)) for i in range(3)]

  def separate(kernels, x):
    return sum(jnp.sum(jnp.tanh(x @ k)) for k in kernels)

  def fused(kernels, x):
    qkv = x @ jnp.concatenate(kernels, axis=1)
    return sum(jnp.sum(jnp.tanh(part)) for part in jnp.split(qkv, 3, axis=1))

  on, off = (jax.jit(jax.grad(f, argnums=(0, 1))) for f in (fused, separate))
  return compare(lambda: jax.block_until_ready(on(kernels, x)),
                 lambda: jax.block_until_ready(off(kernels, x)), repeats)


def scan_layers(repeats) -> dict:
  """The base training step (16 x 64) compiled and run with scan_layers."""
  config, host = _one_batch('base', get_config('base'))
  rng = jax.random.key(1)
  compile_s, steps = {}, {}
  for name, scan in (('with', True), ('without', False)):
    steps[name], compile_s[name] = _blocking_train_step(
        config.replace(scan_layers=scan), host, rng)
  return {
      'compile': {
          'with_s': compile_s['with'], 'without_s': compile_s['without'],
          'speedup': compile_s['without'] / compile_s['with']},
      'step': compare(steps['with'], steps['without'], repeats)}


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
  experiment.train: each step dispatched with its batch, metrics kept.

  wait: what follows each dispatch: 'nothing' (every step's metrics fetched
  at the end, as at a log), 'fetch' (the step's metrics fetched at once) or
  'block' (the step waited for; metrics fetched at the end).
  """
  config = get_config('copy')
  parallel = DataParallel(config, config.parallel)
  rng = jax.random.key(1)
  first = parallel.put_state(create_train_state(config, jax.random.key(0)))

  def run():
    state = jax.tree.map(jnp.copy, first)  # the step donates what it gets
    pending = []
    for step in range(steps):
      state, metrics = parallel.train_step(
          state, parallel.put_batch(copy_task.train_batch(config, step)), rng)
      if wait == 'fetch':
        metrics = parallel.fetch(metrics)
      elif wait == 'block':
        jax.block_until_ready(state)
      pending.append(metrics)
    if wait != 'fetch':
      pending = [parallel.fetch(m) for m in pending]
    jax.block_until_ready(state)
  return run


def metrics_on_device(repeats: int) -> dict:
  return compare(_copy_training_loop(50, 'nothing'),
                 _copy_training_loop(50, 'fetch'), repeats)


def batches_during_step(repeats: int) -> dict:
  return compare(_copy_training_loop(50, 'nothing'),
                 _copy_training_loop(50, 'block'), repeats)


def _multi30k_train_pairs(data_dir: str, config) -> batching.Filtered:
  """Multi30k's de-en training pairs as ids of a vocabulary trained here."""
  paths = parallel_text.local_split_files(
      data_dir, (config.src_lang, config.tgt_lang))['train']

  def lines(path):
    with parallel_text.open_text(path) as f:
      return [line.rstrip('\n') for line in f]

  src, tgt = (lines(path) for path in paths)
  with tempfile.TemporaryDirectory() as vocab_dir:
    tokenizer = spm_lib.train_tokenizer(src + tgt,
                                        os.path.join(vocab_dir, 'spm'), config)
  encode = lambda texts: [np.asarray(ids, np.int32)
                          for ids in tokenizer.encode(texts)]
  return batching.filter_pairs(encode(src), encode(tgt), config.max_len)


def bounded_shapes(data_dir: str) -> dict:
  if not os.path.isdir(data_dir):
    return {'not_run': f'--data_dir={data_dir}: no such directory (the '
                       'Multi30k task-1 raw files)'}
  config = get_config('translate')
  pairs = _multi30k_train_pairs(data_dir, config)
  buckets = batching.TokenBatches(pairs.src, pairs.tgt, config,
                                  config.tokens_per_batch)
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

  parallel = DataParallel(config, config.parallel)
  state = parallel.put_state(create_train_state(config, jax.random.key(0)))
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


# Best-of-`repeats` training-step seconds in a fresh process, malloc kept or
# not (argv: with|without, config name, batch, length, repeats); it must not
# import benchmarks/common.py, which keeps freed memory on import.
_STEP_IN_A_PROCESS = """
import sys
from flaxformer_mini import host_memory
if sys.argv[1] == 'with':
  host_memory.keep_freed_memory()
import functools, time
import jax, numpy as np
from flaxformer_mini.config import get_config
from flaxformer_mini.masks import make_batch
from flaxformer_mini.training import create_train_state, train_step
batch, length = int(sys.argv[3]), int(sys.argv[4])
config = get_config(sys.argv[2]).replace(batch_size=batch, dropout_rate=0.1)
ids = np.random.default_rng(0).integers(
    3, config.src_vocab_size, (batch, length + 1)).astype(np.int32)
ids[:, 0] = config.bos_id
batch = make_batch(ids[:, 1:], ids, config)
step = jax.jit(functools.partial(train_step, config=config), donate_argnums=0)
state, rng = create_train_state(config, jax.random.key(0)), jax.random.key(1)
times = []
for _ in range(int(sys.argv[5]) + 1):
  start = time.perf_counter()
  state, metrics = step(state, batch, rng)
  jax.block_until_ready((state, metrics))
  times.append(time.perf_counter() - start)
print(min(times[1:]))
"""


def keep_freed_memory(config_name: str, repeats: int) -> dict:
  def best_step_s(mode):
    done = subprocess.run(
        [sys.executable, '-c', _STEP_IN_A_PROCESS, mode, config_name,
         *map(str, train_bench.SHAPES[config_name]), str(repeats)],
        check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])

  with_s, without_s = best_step_s('with'), best_step_s('without')
  return {'with_s': with_s, 'without_s': without_s,
          'speedup': without_s / with_s}


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
  scanned = functools.cache(lambda: scan_layers(few))  # one run, two levers
  levers = {
      'cross_attention_memory':
          (lambda: cross_attention_memory(config, args.repeats), True),
      'beams_share_memory':
          (lambda: beams_share_memory(config, args.repeats), True),
      'two_stage_top_k': (lambda: two_stage_top_k(config, args.repeats),
                          False),
      'two_reduction_argmax':
          (lambda: two_reduction_argmax(config, args.repeats), True),
      'closed_form_loss': (lambda: closed_form_loss(config, args.repeats),
                           True),
      'tied_logits_vjp': (lambda: tied_logits_vjp(config, args.repeats),
                          True),
      'donated_state': (lambda: donated_state(config, args.repeats), True),
      'fused_qkv': (lambda: fused_qkv(config, args.repeats), False),
      'dense_weight_gradient':
          (lambda: dense_weight_gradient(args.config, few), True),
      'table_major_logits': (lambda: table_major_logits(few), True),
      'compilation_cache': (lambda: compilation_cache(args.repeats), True),
      'fused_attention': (lambda: fused_attention(config, few), 'option'),
      'scan_layers_compile': (lambda: scanned()['compile'], 'option'),
      'scan_layers_step': (lambda: scanned()['step'], 'option'),
      'keep_freed_memory':
          (lambda: keep_freed_memory(args.config, args.repeats), True),
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
