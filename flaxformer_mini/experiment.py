"""A training run: the loop around the pure step, progress, checkpoints, results.

The loop keeps each step's metrics on the device and fetches them every
`log_every` steps, so the host never waits for the device between two logs.
It saves a checkpoint every `checkpoint_every` steps and at the end, turns
SIGINT / SIGTERM into a last checkpoint and a clean exit, and stops at the
first non-finite loss without saving it.
"""

import dataclasses
import functools
import json
import os
import signal
import time
from typing import Callable

import jax
import numpy as np
import tqdm
from jax.experimental import multihost_utils

from flaxformer_mini import decoding, logbook, plots
from flaxformer_mini.checkpoints import (CheckpointError, Checkpoints,
                                         config_differences, set_aside)
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.data import copy_task
from flaxformer_mini.masks import Batch
from flaxformer_mini.parallel import (DataParallel, check_divisible, host_rows,
                                      pad_rows)
from flaxformer_mini.training import TrainState, create_train_state

# Exact match is measured on at least this many fresh sequences.
COPY_EVAL_SEQUENCES = 1024
_SUMMED = ('loss_sum', 'ntokens', 'correct')

# evaluate(state) -> (score, higher is better; stop training now?)
Evaluate = Callable[[TrainState], tuple[float, bool]]


class Interrupted(Exception):
  """SIGINT or SIGTERM arrived; a checkpoint of the last step was saved."""

  def __init__(self, signum: int, step: int, checkpoint: str | None):
    self.signum, self.step, self.checkpoint = signum, step, checkpoint
    where = (f'checkpoint saved at {checkpoint}; run the same command again '
             'to resume' if checkpoint else 'no checkpoint directory was set')
    super().__init__(f'interrupted by {signal.Signals(signum).name} after '
                     f'step {step}: {where}.')


class NonFiniteLoss(Exception):
  """The loss became NaN or infinite; nothing after the last good step is saved."""

  def __init__(self, step: int, value: float, last_good: int | None):
    self.step = step
    kept = (f'the latest checkpoint, step {last_good}, is the last good one'
            if last_good is not None else 'no checkpoint was written')
    super().__init__(
        f'the loss became {value} at step {step}; training stopped and {kept}. '
        'Lower --lr_factor, raise --warmup_steps, or use float32.')


class _SignalCatcher:
  """Records SIGINT / SIGTERM instead of dying mid-step (main thread only)."""

  def __init__(self):
    self.received: int | None = None
    self._previous = {}

  def __enter__(self):
    try:
      for signum in (signal.SIGINT, signal.SIGTERM):
        self._previous[signum] = signal.signal(signum, self._record)
    except ValueError:  # not the main thread: leave the handlers alone
      pass
    return self

  def _record(self, signum, frame):
    del frame
    self.received = signum

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)


def train(config: TransformerConfig, state: TrainState, rng,
          batch_at: Callable[[int], Batch], evaluate: Evaluate | None = None,
          parallel: DataParallel | None = None,
          checkpoints: Checkpoints | None = None,
          log: logbook.Logbook | None = None):
  """Runs the data-parallel train_step from state.step to config.train_steps.

  Args:
    config: the run's config.
    state: the initial TrainState (one ordinary copy, or replicated).
    rng: the base dropout key (see train_step).
    batch_at: step -> this process's rows of the Batch of that step.
    evaluate: called every `eval_every` steps with one ordinary copy of the
      state; its score is saved with the checkpoint, and it may stop training.
    parallel: how the step is mapped over the devices (default: every
      device, with config.parallel).
    checkpoints: where to save every `checkpoint_every` steps and at the end.
    log: where each logged record goes as well (metrics.jsonl, TensorBoard).

  Returns:
    (final state, history): one dict per log with step, loss, accuracy,
    learning_rate and target tokens/s.

  Raises:
    Interrupted: after SIGINT / SIGTERM, once the checkpoint is written.
    NonFiniteLoss: at the first step whose loss is not finite.
  """
  parallel = parallel or DataParallel(config, config.parallel)
  history, pending = [], []  # pending: per-step metrics not yet fetched
  last_saved = checkpoints.latest_step() if checkpoints else None
  first_step = int(state.step)
  placed = parallel.put_state(state)
  window_start = started = last_check = time.perf_counter()
  deadline = config.max_train_minutes * 60 or float('inf')

  def check_pending():
    """Fetches the pending metrics; raises at the first non-finite loss."""
    fetched = [parallel.fetch(m) for m in pending]
    for offset, metrics in enumerate(fetched):
      if not np.isfinite(metrics['loss_sum']):
        raise NonFiniteLoss(done - len(fetched) + offset + 1,
                            float(metrics['loss_sum']), last_saved)
    return fetched

  def save(step, score=None):
    nonlocal last_saved
    if checkpoints is not None and last_saved != step:
      checkpoints.save(step, parallel.savable_state(placed), rng, config,
                       score)
      last_saved = step

  with tqdm.tqdm(total=config.train_steps, initial=first_step,
                 unit='step', dynamic_ncols=True,
                 disable=jax.process_index() > 0) as progress, \
      _SignalCatcher() as signals:
    done = first_step
    try:
      for step in range(first_step, config.train_steps):
        placed, metrics = parallel.train_step(
            placed, parallel.put_batch(batch_at(step)), rng)
        pending.append(metrics)
        done = step + 1
        if done % config.log_every == 0 or done == config.train_steps:
          fetched = check_pending()
          sums = {k: sum(m[k] for m in fetched) for k in _SUMMED}
          seconds = time.perf_counter() - window_start
          record = {
              'step': done,
              'loss': float(sums['loss_sum'] / max(sums['ntokens'], 1)),
              'accuracy': float(sums['correct'] / max(sums['ntokens'], 1)),
              'learning_rate': float(fetched[-1]['learning_rate']),
              'target_tokens_per_s': float(sums['ntokens'] / seconds),
          }
          history.append(record)
          if log is not None:
            log.write('train', record)
          progress.set_postfix(loss=f"{record['loss']:.4f}",
                               lr=f"{record['learning_rate']:.2e}",
                               tok_s=f"{record['target_tokens_per_s']:.0f}")
          progress.update(done - progress.n)
          pending, window_start = [], time.perf_counter()
        score, stop = None, False
        if evaluate is not None and done % config.eval_every == 0:
          score, stop = evaluate(parallel.get_state(placed))
        # The time limit is checked at log boundaries, where the host syncs:
        # stop at the last one the budget reaches, judging the next window
        # (steps and any evaluation) by the one just finished.
        if not pending:
          now = time.perf_counter()
          if now - started + (now - last_check) > deadline:
            tqdm.tqdm.write(f'--max_train_minutes={config.max_train_minutes}'
                            f': stopping after step {done}, as the next '
                            f'{config.log_every} steps would pass it')
            stop = True
          last_check = now
        every = config.checkpoint_every
        if ((every and done % every == 0) or score is not None or stop or
            signals.received is not None):
          check_pending()  # never save a state whose loss went non-finite
          save(done, score)
        if signals.received is not None:
          raise Interrupted(signals.received, done,
                            checkpoints and checkpoints.step_path(done))
        if stop:
          break
      check_pending()
      save(done)
    finally:
      if checkpoints is not None:
        checkpoints.wait()
  return parallel.get_state(placed), history


def decode_sharded(decode_fn, params, sources: np.ndarray,
                   parallel: DataParallel, pad_id: int) -> np.ndarray:
  """Runs decode_fn(params, src) with the rows of `sources` split over devices.

  sources: [n, src_len], the same on every process; padded with rows of pad
  to divide over the devices, and those rows are dropped from the result.
  """
  padded = pad_rows(sources, parallel.num_devices, pad_id)
  out = decode_fn(parallel.replicate(params),
                  parallel.put_rows(host_rows(padded)))
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


def resume_or_start(config: TransformerConfig, checkpoints: Checkpoints,
                    parallel: DataParallel) -> tuple[TrainState, object, int]:
  """The latest checkpoint of a compatible run, or a fresh state.

  Returns (state, dropout key, the step resumed from or 0).

  Raises:
    CheckpointError: the checkpoints were written with a different config,
      or the latest one cannot be read.
  """
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  state = create_train_state(config, init_rng)
  latest = checkpoints.latest_step()
  if latest is None:
    return state, dropout_rng, 0
  differences = config_differences(checkpoints.read_meta(latest)['config'],
                                   config)
  if differences:
    raise CheckpointError(
        f'{checkpoints.directory} holds checkpoints of another config ('
        + '; '.join(differences) + '). Use those values, another --workdir, '
        'or --fresh to set the old checkpoints aside and start over.')
  state, meta = checkpoints.restore(latest, state, parallel.replicated)
  rng = jax.random.wrap_key_data(np.asarray(meta['rng'], np.uint32))
  return state, rng, latest


def write_results(workdir: str, results: dict) -> str:
  """Writes WORKDIR/results.json; returns its absolute path."""
  path = os.path.abspath(os.path.join(workdir, 'results.json'))
  with open(path, 'w') as f:
    json.dump(results, f, indent=2)
  return path


def open_run(config: TransformerConfig, workdir: str, parallel: DataParallel,
             fresh: bool):
  """WORKDIR/checkpoints, resumed from if it holds a run (set aside if fresh).

  Returns (checkpoints, state, dropout key, the step resumed from or 0,
  the run's Logbook or None on processes other than the first).
  """
  directory = os.path.join(workdir, 'checkpoints')
  if fresh and (moved := set_aside(directory)):
    print(f'--fresh: the old checkpoints are now in {moved}')
  checkpoints = Checkpoints(directory, config.keep_checkpoints)
  state, rng, resumed_from = resume_or_start(config, checkpoints, parallel)
  if resumed_from:
    print(f'resuming from step {resumed_from} of {checkpoints.directory}')
  log = (logbook.Logbook(workdir, resumed_from)
         if jax.process_index() == 0 else None)
  return checkpoints, state, rng, resumed_from, log


def close_run(workdir: str, checkpoints: Checkpoints,
              log: logbook.Logbook | None, title: str) -> None:
  """Waits for the last checkpoint; closes the logbook and draws curves.png."""
  checkpoints.close()
  if log is not None:
    log.close()
    if logbook.read_records(workdir).get('train'):  # none if stopped early
      plots.training_curves(workdir, title)


def run_copy_task(config: TransformerConfig, workdir: str, start_time: float,
                  fresh: bool = False) -> dict:
  """Trains on the copy task until it copies, then evaluates on fresh data.

  Resumes from WORKDIR/checkpoints when they exist (and were written with a
  compatible config); `fresh` sets them aside first. Training stops early once
  a fresh evaluation draw is copied exactly. Writes `results.json` into
  `workdir` and returns its contents.
  """
  check_divisible(config.batch_size)
  os.makedirs(workdir, exist_ok=True)
  parallel = DataParallel(config, config.parallel)
  checkpoints, state, rng, resumed_from, log = open_run(
      config, workdir, parallel, fresh)
  decode_fn = jax.jit(functools.partial(
      decoding.greedy_decode, config=config, max_len=config.copy_length + 1))

  def evaluate(state: TrainState) -> tuple[float, bool]:
    # The draw is the step, so a resumed run evaluates on the same data.
    match, _, _ = copy_exact_match(state.params, config, decode_fn,
                                   int(state.step), parallel)
    tqdm.tqdm.write(f'step {int(state.step)}: exact match {match:.4f} on '
                    f'{COPY_EVAL_SEQUENCES} fresh sequences')
    if log is not None:
      log.write('eval', {'step': int(state.step), 'exact_match': match})
    return match, match == 1.0

  shard = (jax.process_index(), jax.process_count())
  try:
    state, history = train(
        config, state, rng,
        lambda step: copy_task.train_batch(config, step, shard), evaluate,
        parallel, checkpoints, log)
  finally:
    close_run(workdir, checkpoints, log, 'copy task')
  # Draw 0 is never used during training: the final score is on unseen data.
  match, sources, decoded = copy_exact_match(state.params, config, decode_fn, 0,
                                             parallel)
  results = {
      'task': 'copy',
      'config': dataclasses.asdict(config),
      'devices': jax.device_count(),
      'processes': jax.process_count(),
      'steps': int(state.step),
      'resumed_from': resumed_from,
      'final_loss': history[-1]['loss'] if history else None,
      'exact_match': match,
      'eval_sequences': COPY_EVAL_SEQUENCES,
      'checkpoints': checkpoints.directory,
      'wall_seconds': time.perf_counter() - start_time,
      'history': history,
  }
  if jax.process_index() == 0:  # one writer in a multi-host run
    for source, output in list(zip(sources, decoded))[:4]:
      print(f'source: {" ".join(map(str, source))}\n'
            f'output: {" ".join(map(str, output))}')
    path = write_results(workdir, results)
    print(f'exact match {match:.4f} after {results["steps"]} steps on '
          f'{results["devices"]} device(s), {results["wall_seconds"]:.1f} s; '
          f'results in {path}')
  return results


def pairs_of(source, languages: tuple[str, str]) -> tuple[list[str],
                                                          list[str]]:
  """All (source text, target text) of a TFDS data source, in order."""
  examples = source.__getitems__(range(len(source)))
  return ([e[languages[0]].decode('utf-8') for e in examples],
          [e[languages[1]].decode('utf-8') for e in examples])


def run_translate(config: TransformerConfig, workdir: str, start_time: float,
                  data_dir: str | None = None, dataset: str | None = None,
                  tfds_dir: str | None = None, fresh: bool = False) -> dict:
  """Trains and evaluates a translation model on real parallel text.

  Data: local files (`data_dir`, e.g. Multi30k) through the project's TFDS
  builder, or a prepared TFDS catalog `dataset`. A joint SentencePiece
  vocabulary is trained on the training split once and kept in the workdir.
  Every `eval_every` steps: validation loss, perplexity and sacreBLEU (beam
  search); at the end sacreBLEU on the test split. Writes results.json.
  """
  # pylint: disable=g-import-not-at-top
  from flaxformer_mini import evaluation, translate
  from flaxformer_mini.data import batching, parallel_text, tokenizer as spm_lib
  languages = (config.src_lang, config.tgt_lang)
  os.makedirs(workdir, exist_ok=True)
  if data_dir:
    splits = parallel_text.load_local(
        data_dir, languages, tfds_dir or os.path.join(workdir, 'tfds'))
  else:
    splits = parallel_text.load_catalog(dataset, tfds_dir)
  texts = {split: pairs_of(source, languages) for split, source in
           splits.items()}
  test_split = next((s for s in texts if s not in ('train', 'validation')),
                    'validation')
  vocab_path = translate.tokenizer_path(workdir)
  if os.path.isfile(vocab_path + '.model'):
    tokenizer = spm_lib.load_tokenizer(vocab_path)
  else:
    train_src, train_tgt = texts['train']
    tokenizer = spm_lib.train_tokenizer(train_src + train_tgt, vocab_path,
                                        config)
  spm_lib.check_special_ids(tokenizer, config)

  def encode(split):
    src, tgt = texts[split]
    return [np.asarray(ids, np.int32) for ids in tokenizer.encode(src)], [
        np.asarray(ids, np.int32) for ids in tokenizer.encode(tgt)]

  train_pairs = batching.filter_pairs(*encode('train'), config.max_len)
  rows = jax.device_count()
  train_batches = batching.TokenBatches(
      train_pairs.src, train_pairs.tgt, config, config.tokens_per_batch, rows)
  val_pairs = batching.filter_pairs(*encode('validation'), config.max_len)
  val_batches = batching.TokenBatches(
      val_pairs.src, val_pairs.tgt, config, config.tokens_per_batch, rows,
      shuffle=False)
  held_out = [val_batches.make(members, length, val_batches.rows_of(length))
              for length, members in val_batches.epoch_batches()]
  print(f'train: {len(train_pairs.src)} pairs in {train_batches.per_epoch} '
        f'batches per epoch ({len(train_batches.shapes())} shapes); skipped '
        f'{train_pairs.empty} empty and {train_pairs.too_long} longer than '
        f'--max_len={config.max_len}')

  parallel = DataParallel(config, config.parallel)
  checkpoints, state, rng, resumed_from, log = open_run(
      config, workdir, parallel, fresh)
  evaluations = []

  def bleu_on(params, split):
    sources, references = texts[split]
    hypotheses = translate.translate_lines(
        params, config, tokenizer, sources, config.eval_beam_size,
        config.eval_alpha)
    return evaluation.bleu(hypotheses, references)

  def evaluate(state: TrainState) -> tuple[float, bool]:
    # Only the parameters go to the devices; the optimizer state is not needed.
    loss = evaluation.held_out_loss(
        parallel, parallel.put_state(state.params), held_out)
    score, _ = bleu_on(state.params, 'validation')
    evaluations.append({'step': int(state.step), 'val_loss': loss['loss'],
                        'val_perplexity': loss['perplexity'],
                        'val_bleu': score})
    if log is not None:
      log.write('eval', evaluations[-1])
    tqdm.tqdm.write(f'step {int(state.step)}: validation loss '
                    f'{loss["loss"]:.3f}, perplexity {loss["perplexity"]:.2f}, '
                    f'BLEU {score:.2f}')
    return score, False

  shard = (jax.process_index(), jax.process_count())
  try:
    state, history = train(
        config, state, rng, lambda step: train_batches.batch_at(step, shard),
        evaluate, parallel, checkpoints, log)
  finally:
    close_run(workdir, checkpoints, log,
              f'{languages[0]} -> {languages[1]} translation')
  test_bleu, signature = bleu_on(state.params, test_split)
  results = {
      'task': 'translate',
      'config': dataclasses.asdict(config),
      'data': {'data_dir': data_dir, 'dataset': dataset,
               'pairs': {split: len(pairs[0]) for split, pairs in
                         texts.items()},
               'train_pairs_used': len(train_pairs.src),
               'train_skipped_empty': train_pairs.empty,
               'train_skipped_too_long': train_pairs.too_long,
               'batches_per_epoch': train_batches.per_epoch,
               'batch_shapes': sorted(train_batches.shapes())},
      'vocabulary': {'path': vocab_path + '.model',
                     'size': tokenizer.get_piece_size(), 'type': 'unigram',
                     'joint': True},
      'devices': jax.device_count(),
      'steps': int(state.step),
      'resumed_from': resumed_from,
      'final_loss': history[-1]['loss'] if history else None,
      'test_split': test_split,
      'test_bleu': test_bleu,
      'bleu_signature': signature,
      'beam_size': config.eval_beam_size,
      'alpha': config.eval_alpha,
      'evaluations': evaluations,
      'wall_seconds': time.perf_counter() - start_time,
      'history': history,
  }
  if jax.process_index() == 0:  # one writer in a multi-host run
    path = write_results(workdir, results)
    print(f'sacreBLEU {test_bleu:.2f} on {test_split} ({signature}) after '
          f'{results["steps"]} steps, {results["wall_seconds"]:.0f} s; '
          f'results in {path}')
  return results
