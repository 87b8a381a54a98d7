"""The copy task: train until the model copies fresh random sequences exactly.

`run` trains on batches that are a pure function of (seed, step), evaluates
greedy exact match on fresh sequences every `eval_every` steps, stops after
PERFECT_IN_A_ROW evaluations in a row copy every sequence, then scores a last
draw that training never saw and writes WORKDIR/results.json.
"""

import functools
import time

import jax
import numpy as np
import tqdm

from flaxformer_mini import decoding, logbook
from flaxformer_mini.config import ConfigError, TransformerConfig
from flaxformer_mini.data import copy_task
from flaxformer_mini.loop import SignalCatcher
from flaxformer_mini.run import TrainingRun
from flaxformer_mini.parallel import (DataParallel, check_divisible,
                                      decode_sharded)
from flaxformer_mini.training import TrainState
from flaxformer_mini.workdir import Workdir

# Exact match is measured on this many fresh sequences per evaluation.
EVAL_SEQUENCES = 1024
# One perfect evaluation can be luck near the end of learning: after three in
# a row 2e-4 of fresh sequences were still miscopied (a final draw of 1,024
# then fails one time in five). After five, with the copy preset's label
# smoothing, 1 of 393,216 further fresh sequences over 8 seeds on two jax
# versions (docs/copy-task.md).
PERFECT_IN_A_ROW = 5


def check_config(config: TransformerConfig) -> None:
  """The copy task's own fields, checked before anything is compiled.

  Raises:
    ConfigError: naming the field.
  """
  if config.copy_length + 2 > config.max_len:
    raise ConfigError(f'copy_length={config.copy_length}: with bos and eos '
                      f'it must fit in max_len={config.max_len}.')
  smallest = min(config.src_vocab_size, config.tgt_vocab_size)
  if config.first_ordinary_id >= smallest:
    raise ConfigError(
        f'src_vocab_size={config.src_vocab_size}: the copy task needs '
        'ordinary tokens above the special ids; raise src_vocab_size and '
        f'tgt_vocab_size above {config.first_ordinary_id}.')
  check_divisible(config.batch_size, config)


def greedy_copier(config: TransformerConfig):
  """The jitted greedy search of the copy task: (params, src int32[batch,
  copy_length]) -> int32[batch, copy_length + 1], the copy and its eos."""
  return jax.jit(functools.partial(
      decoding.greedy_decode, config=config, max_len=config.copy_length + 1))


def exact_match(params, config: TransformerConfig, decode_fn, draw: int,
                parallel: DataParallel) -> tuple[float, np.ndarray, np.ndarray]:
  """Greedy-decodes EVAL_SEQUENCES fresh sequences of draw `draw`.

  Returns (exact-match fraction, sources int32[n, copy_length], decodes
  int32[n, copy_length + 1]).
  """
  sources = copy_task.eval_sequences(config, EVAL_SEQUENCES, draw)
  decoded = decode_sharded(decode_fn, params, sources, parallel, config.pad_id)
  return copy_task.exact_match(decoded, sources, config), sources, decoded


def _perfect_streak(matches: list[float]) -> int:
  """Evaluations in a row, counted back from the last, that were perfect."""
  streak = 0
  for match in reversed(matches):
    if match != 1.0:
      break
    streak += 1
  return streak


def run(config: TransformerConfig, workdir_path: str, fresh: bool = False,
        start_time: float | None = None) -> dict:
  """Trains on the copy task until it copies, then evaluates on fresh data.

  Resumes from WORKDIR/checkpoints when they hold a run of a compatible
  config; `fresh` first sets everything earlier runs wrote aside. Writes
  WORKDIR/results.json and returns its contents.

  Raises:
    ConfigError, WorkdirError, CheckpointError: before anything compiles.
    loop.NonFinite, loop.Interrupted: see loop.train.
  """
  start_time = time.perf_counter() if start_time is None else start_time
  check_config(config)
  with Workdir(workdir_path) as workdir, SignalCatcher() as signals:
    if fresh and (moved := workdir.set_aside()):
      print(f'--fresh: the earlier run is now in {moved}')
    parallel = DataParallel(config)
    training = TrainingRun.open('copy', config, workdir, parallel)
    decode_fn = greedy_copier(config)
    # The exact match of every evaluation so far, a resumed run's included.
    matches = [record.get('exact_match') for record in
               logbook.read_records(workdir.path).get('eval', [])
               ] if training.resumed_from else []

    def evaluate(state: TrainState) -> tuple[float, bool]:
      # The draw is the step, so a resumed run evaluates on the same data.
      match, _, _ = exact_match(state.params, config, decode_fn,
                                int(state.step), parallel)
      tqdm.tqdm.write(f'step {int(state.step)}: exact match {match:.4f} on '
                      f'{EVAL_SEQUENCES} fresh sequences')
      if training.log is not None:
        training.log.write('eval', {'step': int(state.step), 'exact_match': match})
      matches.append(match)
      return match, _perfect_streak(matches) >= PERFECT_IN_A_ROW

    shard = (jax.process_index(), jax.process_count())
    with training.closing('copy task'):
      state, history = training.train(
          lambda step: copy_task.train_batch(config, step, shard), evaluate,
          signals)
    signals.when = 'during the final evaluation'
    # Draw 0 is never used during training: the final score is on unseen data.
    match, sources, decoded = exact_match(state.params, config, decode_fn, 0,
                                          parallel)
    results = training.results(state, history, start_time,
                               exact_match=match,
                               eval_sequences=EVAL_SEQUENCES)
    if path := training.write_results(results):
      for source, output in list(zip(sources, decoded))[:4]:
        shown = decoding.tokens_before_eos(output, config.eos_id,
                                           config.pad_id)
        print(f'source: {" ".join(map(str, source))}\n'
              f'output: {" ".join(map(str, shown))}')
      print(f'exact match {match:.4f} after {results["steps"]} steps on '
            f'{results["devices"]} device(s), {results["wall_seconds"]:.1f} '
            f's; results in {path}')
  return results
