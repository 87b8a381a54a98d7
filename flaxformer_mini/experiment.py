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

from flaxformer_mini import decoding
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.data import copy_task
from flaxformer_mini.masks import Batch
from flaxformer_mini.training import TrainState, create_train_state, train_step

# Exact match is measured on at least this many fresh sequences.
COPY_EVAL_SEQUENCES = 1024
_SUMMED = ('loss_sum', 'ntokens', 'correct')


def train(config: TransformerConfig, state: TrainState, rng,
          batch_at: Callable[[int], Batch],
          evaluate: Callable[[TrainState], bool] | None = None):
  """Runs train_step from state.step up to config.train_steps.

  Args:
    config: the run's config.
    state: the initial TrainState.
    rng: the base dropout key (see train_step).
    batch_at: step -> the Batch of that step.
    evaluate: called every `eval_every` steps; returning True stops early.

  Returns:
    (final state, history): one dict per log with step, loss, accuracy,
    learning_rate and target tokens/s.
  """
  step_fn = jax.jit(functools.partial(train_step, config=config),
                    donate_argnums=0)
  history = []
  first_step = int(state.step)
  window, window_start = None, time.perf_counter()
  with tqdm.tqdm(total=config.train_steps, initial=first_step,
                 unit='step', dynamic_ncols=True) as progress:
    for step in range(first_step, config.train_steps):
      state, metrics = step_fn(state, batch_at(step), rng)
      summed = {k: metrics[k] for k in _SUMMED}
      window = summed if window is None else jax.tree.map(
          lambda a, b: a + b, window, summed)
      done = step + 1
      if done % config.log_every == 0 or done == config.train_steps:
        fetched = jax.device_get(window)
        seconds = time.perf_counter() - window_start
        record = {
            'step': done,
            'loss': float(fetched['loss_sum'] / max(fetched['ntokens'], 1)),
            'accuracy': float(fetched['correct'] / max(fetched['ntokens'], 1)),
            'learning_rate': float(metrics['learning_rate']),
            'target_tokens_per_s': float(fetched['ntokens'] / seconds),
        }
        history.append(record)
        progress.set_postfix(loss=f"{record['loss']:.4f}",
                             lr=f"{record['learning_rate']:.2e}",
                             tok_s=f"{record['target_tokens_per_s']:.0f}")
        progress.update(done - progress.n)
        window, window_start = None, time.perf_counter()
      if evaluate is not None and done % config.eval_every == 0:
        if evaluate(state):
          break
  return state, history


def copy_exact_match(params, config: TransformerConfig, decode_fn,
                     draw: int) -> tuple[float, np.ndarray, np.ndarray]:
  """Greedy-decodes COPY_EVAL_SEQUENCES fresh sequences of draw `draw`.

  Returns (exact-match fraction, sources [n, L], decodes [n, L + 1]).
  """
  sources = copy_task.eval_sequences(config, COPY_EVAL_SEQUENCES, draw)
  decoded = np.asarray(decode_fn(params, sources))
  return copy_task.exact_match(decoded, sources, config), sources, decoded


def run_copy_task(config: TransformerConfig, workdir: str,
                  start_time: float, print_fn=print) -> dict:
  """Trains on the copy task until it copies, then evaluates on fresh data.

  Training stops early once a fresh evaluation draw is copied exactly. Writes
  `results.json` into `workdir` and returns its contents.
  """
  os.makedirs(workdir, exist_ok=True)
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  state = create_train_state(config, init_rng)
  decode_fn = jax.jit(functools.partial(
      decoding.greedy_decode, config=config, max_len=config.copy_length + 1))
  draws = iter(range(1, 1_000_000))

  def evaluate(state: TrainState) -> bool:
    match, _, _ = copy_exact_match(state.params, config, decode_fn, next(draws))
    tqdm.tqdm.write(f'step {int(state.step)}: exact match {match:.4f} on '
                    f'{COPY_EVAL_SEQUENCES} fresh sequences')
    return match == 1.0

  state, history = train(config, state, dropout_rng,
                         functools.partial(copy_task.train_batch, config),
                         evaluate)
  # Draw 0 is never used during training: the final score is on unseen data.
  match, sources, decoded = copy_exact_match(state.params, config, decode_fn, 0)
  for source, output in list(zip(sources, decoded))[:4]:
    print_fn(f'source: {" ".join(map(str, source))}\n'
             f'output: {" ".join(map(str, output))}')
  results = {
      'task': 'copy',
      'config': dataclasses.asdict(config),
      'steps': int(state.step),
      'final_loss': history[-1]['loss'] if history else None,
      'exact_match': match,
      'eval_sequences': COPY_EVAL_SEQUENCES,
      'wall_seconds': time.perf_counter() - start_time,
      'history': history,
  }
  path = os.path.abspath(os.path.join(workdir, 'results.json'))
  with open(path, 'w') as f:
    json.dump(results, f, indent=2)
  print_fn(f'exact match {match:.4f} after {results["steps"]} steps, '
           f'{results["wall_seconds"]:.1f} s; results in {path}')
  return results
