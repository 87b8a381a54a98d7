"""Training-step throughput and MFU of the project's real training step.

  python benchmarks/train_step.py --config small --pad full
  python benchmarks/train_step.py --config small --cpu_kernels   # the CPU seam
  python benchmarks/train_step.py --config base --pad pad20 --peak_gflops 90
  python benchmarks/train_step.py --config base --dtype bfloat16 --batch 256

The step is the one `train.py` runs: `DataParallel.train_step` over every
device (label-smoothed KL with eps 0.1, dropout 0.1, Adam + the Noam
schedule, donated state), on fixed synthetic batches of random token ids.
`--pad full`: every sentence has the full length; `pad20`: each sentence's
length is uniform in [0.6 L, L] (about 20 % padding). Compile time is the
ahead-of-time lower + compile, apart; `step_s` is the median of --steps steps
after a warm-up, each run to completion. --batch overrides the batch size of
SHAPES: on a GPU or TPU base's 16 x 64 tokens cannot fill the chip, so the
accelerator suite also measures a batch the size of the paper's per-step
batches.

FLOPs (README, "Performance"): the matrix products of the traced training
step, forward and backward (benchmarks/flops.py), over all positions, pad
included. MFU divides by the measured matmul peak (benchmarks/peak.py;
measured here unless --peak_gflops is given).

The Flax WMT example's model (benchmarks/flax_wmt.py) runs on the same
batches in the same process, its steps interleaved with ours so that both see
the same machine; `speedup` is its median step time over ours, with a 90 %
bootstrap interval (common.speedup). --no_baseline skips it.
"""

import argparse
import itertools
import time

import jax
import numpy as np

from flaxformer_mini.config import get_config
from flaxformer_mini.masks import make_batch
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.training import create_train_state

import common
import flax_wmt
import flops as flops_lib
import peak

# The measured shapes: (sentences per batch, source = target length).
SHAPES = {'small': (64, 32), 'base': (16, 64)}


def synthetic_batches(config, batch: int, length: int, pad: str,
                      count: int = 4):
  """`count` Batches of random ids; sentence lengths per --pad."""
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(count):
    lengths = (np.full(batch, length) if pad == 'full' else
               rng.integers(int(0.6 * length), length + 1, batch))
    src = np.full((batch, length), config.pad_id, np.int32)
    tgt = np.full((batch, length + 1), config.pad_id, np.int32)
    tgt[:, 0] = config.bos_id
    for row, n in enumerate(lengths):
      src[row, :n] = rng.integers(3, config.src_vocab_size, n)
      tgt[row, 1:n] = rng.integers(3, config.tgt_vocab_size, n - 1)
      tgt[row, n] = config.eos_id
    batches.append(make_batch(src, tgt, config))
  return batches


def compile_timed(step, state, batch, rng):
  """A jitted step compiled ahead of time -> (compiled, seconds it took)."""
  start = time.perf_counter()
  compiled = step.lower(state, batch, rng).compile()
  return compiled, time.perf_counter() - start


def blocking_run(step, state, batches, rng, compile_s: float | None) -> dict:
  """A run whose advance() makes the next step and waits for it to finish."""
  holder = {'state': state}
  batches_in_turn = itertools.cycle(batches)

  def advance():
    holder['state'], metrics = step(holder['state'], next(batches_in_turn),
                                    rng)
    jax.block_until_ready((holder['state'], metrics))

  return {'advance': advance, 'compile_s': compile_s}


def _baseline(config, host_batches, init_rng, dropout_rng) -> dict:
  """The Flax WMT example's run on the same batches."""
  models, _ = flax_wmt.load()
  state = flax_wmt.create_state(models, config, init_rng)
  batches = [jax.device_put(b) for b in host_batches]
  step, compile_s = compile_timed(flax_wmt.jitted_train_step(config), state,
                                  batches[0], dropout_rng)
  return blocking_run(step, state, batches, dropout_rng, compile_s)


def measure(config, batch: int, length: int, pad: str, steps: int,
            peak_gflops: float, baseline: bool) -> dict:
  """Our step (and the baselines'), interleaved; medians of `steps` steps."""
  parallel = DataParallel(config)
  init_rng, dropout_rng = jax.random.split(jax.random.key(0))
  host_batches = synthetic_batches(config, batch, length, pad)
  state = parallel.replicate(create_train_state(config, init_rng))
  batches = [parallel.put_batch(b) for b in host_batches]
  step, compile_s = compile_timed(parallel.train_step, state, batches[0],
                                  dropout_rng)
  runs = {'ours': blocking_run(step, state, batches, dropout_rng, compile_s)}
  if baseline:
    runs['flax_wmt'] = _baseline(config, host_batches, init_rng, dropout_rng)
  advances = {name: run['advance'] for name, run in runs.items()}
  common.interleaved_seconds(advances, 2)  # warm-up
  times = common.interleaved_seconds(advances, steps)

  real = np.mean([int((np.asarray(b.src) != config.pad_id).sum()) +
                  int(b.ntokens) for b in host_batches])
  target = np.mean([int(b.ntokens) for b in host_batches])
  flops = flops_lib.step_flops(config, batch, length, length)

  def figures(name):
    step_s = float(np.median(times[name]))
    return {'compile_s': runs[name]['compile_s'], 'step_s': step_s,
            'tokens_per_s': real / step_s,
            'target_tokens_per_s': target / step_s,
            'mfu': flops / step_s / 1e9 / peak_gflops}

  result = {**figures('ours'), 'gflop_per_step': flops / 1e9,
            'peak_gflops': peak_gflops,
            'padding': 1 - real / (2 * batch * length)}
  if baseline:
    result['flax_wmt'] = figures('flax_wmt')
    result.update(common.speedup(times['flax_wmt'], times['ours']))
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='small', choices=sorted(SHAPES))
  parser.add_argument('--pad', default='full', choices=['full', 'pad20'])
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--dropout', type=float, default=0.1,
                      help='dropout rate (0 measures what dropout costs)')
  parser.add_argument('--batch', type=int,
                      help="sentences per batch (default: the config's shape)")
  parser.add_argument('--dtype', default='float32',
                      choices=['float32', 'bfloat16'])
  parser.add_argument('--cpu_kernels', action='store_true',
                      help='ours only: config.cpu_kernels (cpu_kernels.py)')
  parser.add_argument('--no_baseline', action='store_true',
                      help="skip the Flax WMT example's steps")
  parser.add_argument('--peak_gflops', type=float,
                      help='the matmul peak for MFU (default: measure it)')
  args = parser.parse_args()
  batch, length = SHAPES[args.config]
  batch = args.batch or batch
  config = get_config(args.config).replace(
      dropout_rate=args.dropout, label_smoothing=0.1, batch_size=batch,
      max_len=max(length + 1, 64), dtype=args.dtype,
      cpu_kernels=args.cpu_kernels)
  peak_gflops = args.peak_gflops or peak.measure()['peak_gflops'][args.dtype]
  common.emit({'benchmark': 'train_step', 'config': args.config,
               'pad': args.pad, 'batch': batch, 'length': length,
               'dropout': args.dropout,
               'dtype': args.dtype, 'cpu_kernels': args.cpu_kernels,
               **measure(config, batch, length, args.pad, args.steps,
                         peak_gflops, not args.no_baseline)})


if __name__ == '__main__':
  main()
