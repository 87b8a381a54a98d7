"""A training run: the loop around the pure step, progress, evaluation, results.

The loop keeps metrics on the device and fetches them every `log_every` steps,
so the host never waits for the device between two logs.
"""

import dataclasses
import functools
import json
import os
import time
from typing import Callable

import jax
import numpy as np
import tqdm
from jax.experimental import multihost_utils

from flaxformer_mini import decoding
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.data import copy_task
from flaxformer_mini.masks import Batch
from flaxformer_mini.parallel import DataParallel, check_divisible, pad_rows
from flaxformer_mini.training import TrainState, create_train_state

# Exact match is measured on at least this many fresh sequences.
COPY_EVAL_SEQUENCES = 1024
_SUMMED = ('loss_sum', 'ntokens', 'correct')


def train(config: TransformerConfig, state: TrainState, rng,
          batch_at: Callable[[int], Batch],
          evaluate: Callable[[TrainState], bool] | None = None,
          parallel: DataParallel | None = None):
  """Runs the data-parallel train_step from state.step to config.train_steps.

  Args:
    config: the run's config.
    state: the initial TrainState (one ordinary copy).
    rng: the base dropout key (see train_step).
    batch_at: step -> this process's rows of the Batch of that step.
    evaluate: called every `eval_every` steps with one ordinary copy of the
      state; returning True stops early.
    parallel: how the step is mapped over the devices (default: every
      device, with config.parallel).

  Returns:
    (final state, history): one dict per log with step, loss, accuracy,
    learning_rate and target tokens/s.
  """
  parallel = parallel or DataParallel(config, config.parallel)
  history = []
  first_step = int(state.step)
  placed = parallel.put_state(state)
  window, window_start = None, time.perf_counter()
  with tqdm.tqdm(total=config.train_steps, initial=first_step,
                 unit='step', dynamic_ncols=True,
                 disable=jax.process_index() > 0) as progress:
    for step in range(first_step, config.train_steps):
      placed, metrics = parallel.train_step(
          placed, parallel.put_batch(batch_at(step)), rng)
      summed = {k: metrics[k] for k in _SUMMED}
      window = summed if window is None else jax.tree.map(
          lambda a, b: a + b, window, summed)
      done = step + 1
      if done % config.log_every == 0 or done == config.train_steps:
        fetched = parallel.fetch(window)
        seconds = time.perf_counter() - window_start
        record = {
            'step': done,
            'loss': float(fetched['loss_sum'] / max(fetched['ntokens'], 1)),
            'accuracy': float(fetched['correct'] / max(fetched['ntokens'], 1)),
            'learning_rate': float(parallel.fetch(metrics['learning_rate'])),
            'target_tokens_per_s': float(fetched['ntokens'] / seconds),
        }
        history.append(record)
        progress.set_postfix(loss=f"{record['loss']:.4f}",
                             lr=f"{record['learning_rate']:.2e}",
                             tok_s=f"{record['target_tokens_per_s']:.0f}")
        progress.update(done - progress.n)
        window, window_start = None, time.perf_counter()
      if evaluate is not None and done % config.eval_every == 0:
        if evaluate(parallel.get_state(placed)):
          break
  return parallel.get_state(placed), history


def decode_sharded(decode_fn, params, sources: np.ndarray,
                   parallel: DataParallel, pad_id: int) -> np.ndarray:
  """Runs decode_fn(params, src) with the rows of `sources` split over devices.

  sources: [n, src_len], the same on every process; padded with rows of pad
  to divide over the devices, and those rows are dropped from the result.
  """
  padded = pad_rows(sources, parallel.num_devices, pad_id)
  rows = padded.shape[0] // jax.process_count()
  mine = padded[jax.process_index() * rows:(jax.process_index() + 1) * rows]
  out = decode_fn(parallel.replicate(params), parallel.put_rows(mine))
  return np.asarray(multihost_utils.process_allgather(out, tiled=True))[
      :sources.shape[0]]


def copy_exact_match(params, config: TransformerConfig, decode_fn, draw: int,
                     parallel: DataParallel) -> tuple[float, np.ndarray,
                                                      np.ndarray]:
  """Greedy-decodes COPY_EVAL_SEQUENCES fresh sequences of draw `draw`.

  Returns (exact-match fraction, sources [n, L], decodes [n, L + 1]).
  """
  sources = copy_task.eval_sequences(config, COPY_EVAL_SEQUENCES, draw)
  decoded = decode_sharded(decode_fn, params, sources, parallel, config.pad_id)
  return copy_task.exact_match(decoded, sources, config), sources, decoded


def run_copy_task(config: TransformerConfig, workdir: str,
                  start_time: float) -> dict:
  """Trains on the copy task until it copies, then evaluates on fresh data.

  Training stops early once a fresh evaluation draw is copied exactly. Writes
  `results.json` into `workdir` and returns its contents.
  """
  check_divisible(config.batch_size)
  os.makedirs(workdir, exist_ok=True)
  parallel = DataParallel(config, config.parallel)
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  state = create_train_state(config, init_rng)
  decode_fn = jax.jit(functools.partial(
      decoding.greedy_decode, config=config, max_len=config.copy_length + 1))
  draws = iter(range(1, 1_000_000))

  def evaluate(state: TrainState) -> bool:
    match, _, _ = copy_exact_match(state.params, config, decode_fn, next(draws),
                                   parallel)
    tqdm.tqdm.write(f'step {int(state.step)}: exact match {match:.4f} on '
                    f'{COPY_EVAL_SEQUENCES} fresh sequences')
    return match == 1.0

  shard = (jax.process_index(), jax.process_count())
  state, history = train(
      config, state, dropout_rng,
      lambda step: copy_task.train_batch(config, step, shard), evaluate,
      parallel)
  # Draw 0 is never used during training: the final score is on unseen data.
  match, sources, decoded = copy_exact_match(state.params, config, decode_fn, 0,
                                             parallel)
  results = {
      'task': 'copy',
      'config': dataclasses.asdict(config),
      'devices': jax.device_count(),
      'processes': jax.process_count(),
      'steps': int(state.step),
      'final_loss': history[-1]['loss'] if history else None,
      'exact_match': match,
      'eval_sequences': COPY_EVAL_SEQUENCES,
      'wall_seconds': time.perf_counter() - start_time,
      'history': history,
  }
  if jax.process_index() == 0:  # one writer in a multi-host run
    for source, output in list(zip(sources, decoded))[:4]:
      print(f'source: {" ".join(map(str, source))}\n'
            f'output: {" ".join(map(str, output))}')
    path = os.path.abspath(os.path.join(workdir, 'results.json'))
    with open(path, 'w') as f:
      json.dump(results, f, indent=2)
    print(f'exact match {match:.4f} after {results["steps"]} steps on '
          f'{results["devices"]} device(s), {results["wall_seconds"]:.1f} s; '
          f'results in {path}')
  return results
