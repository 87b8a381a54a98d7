"""Translation on real parallel text: data, vocabulary, training, averaging, BLEU.

`run` prepares the data (local files through the project's TFDS builder, or a
prepared TFDS catalog dataset), trains a joint SentencePiece vocabulary once,
trains with token-budget batches, evaluates every `eval_every` steps
(validation loss and perplexity, and greedy BLEU on the whole validation
split, against the minutes since the run started), and at the end averages
the last `average_last` checkpoints, scores both the last and the averaged
parameters on validation with beam search, keeps the better one for the
translate command and scores it once on the test split.

What is prepared (WORKDIR/tfds, spm.model) is recorded in prepared.json with
what it was prepared from; a later run with other data, languages or
vocabulary is refused (or, with --fresh, prepares again) instead of training
on stale data.
"""

import dataclasses
import os
import time

import jax
import numpy as np
import tqdm

from flaxformer_mini import evaluation, plots
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.checkpoints import Checkpoints, average_params
from flaxformer_mini.config import ConfigError, TransformerConfig
from flaxformer_mini.data import batching, parallel_text
from flaxformer_mini.data import tokenizer as spm_lib
from flaxformer_mini.decoding import translate_lines
from flaxformer_mini.loop import SignalCatcher, TrainingRun
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.training import TrainState
from flaxformer_mini.workdir import Workdir, WorkdirError

# What --fresh keeps when it was prepared from the same data and settings.
_PREPARED = (workdir_lib.TFDS, workdir_lib.TOKENIZER + '.model',
             workdir_lib.TOKENIZER + '.vocab', workdir_lib.PREPARED)


def check_config(config: TransformerConfig) -> None:
  """Translation's own fields, checked before any data is read.

  Raises:
    ConfigError: naming the field.
  """
  if config.src_lang == config.tgt_lang:
    raise ConfigError(f'src_lang={config.src_lang}: the same as tgt_lang.')
  devices = jax.device_count()
  if config.tokens_per_batch < config.max_len * devices:
    raise ConfigError(
        f'tokens_per_batch={config.tokens_per_batch}: holds no batch of '
        f'{devices} row(s) of length max_len={config.max_len}; raise it to at '
        f'least {config.max_len * devices} or lower max_len.')
  if config.average_last > config.keep_checkpoints:
    raise ConfigError(
        f'average_last={config.average_last}: the run keeps only the last '
        f'keep_checkpoints={config.keep_checkpoints}; raise keep_checkpoints '
        'or average fewer.')


def _wanted(config: TransformerConfig, source: str, content: str) -> dict:
  """What the prepared data and vocabulary of this run are made from."""
  return {'source': source, 'content': content,
          'languages': [config.src_lang, config.tgt_lang],
          'vocab_size': config.src_vocab_size,
          'special_ids': [config.pad_id, config.bos_id, config.eos_id]}


def _differences(prepared: dict, wanted: dict) -> str:
  names = {'content': "the data's contents", 'source': 'the data source'}
  return '; '.join(
      f'{names.get(key, key)}: {prepared.get(key)!r} -> {value!r}'
      for key, value in wanted.items() if prepared.get(key) != value)


def prepare(config: TransformerConfig, workdir: Workdir, data_dir: str | None,
            dataset: str | None, tfds_dir: str | None, fresh: bool):
  """The texts of every split and the vocabulary, prepared once per source.

  Returns ({split: (source texts, target texts)}, the SentencePiece model).

  Raises:
    DataError: the data cannot be read or makes no vocabulary of that size.
    WorkdirError: the workdir was prepared from something else (without
      `fresh`).
  """
  languages = (config.src_lang, config.tgt_lang)
  if data_dir:
    files = parallel_text.local_split_files(data_dir, languages)
    source = os.path.abspath(data_dir)
    content = parallel_text.fingerprint(files)
  else:
    source, content = f'tfds:{dataset}', dataset
  wanted = _wanted(config, source, content)
  prepared = workdir.read_json(workdir_lib.PREPARED)
  vocabulary = workdir.path_of(workdir_lib.TOKENIZER)
  earlier = (os.path.isfile(vocabulary + '.model') or
             os.path.isdir(workdir.path_of(workdir_lib.CHECKPOINTS)))
  if fresh:
    keep = _PREPARED if prepared == wanted else ()
    if moved := workdir.set_aside(keep):
      print(f'--fresh: the earlier run is now in {moved}')
  elif prepared is not None and prepared != wanted:
    raise WorkdirError(
        f'{workdir.path} was prepared from other data or settings ('
        f'{_differences(prepared, wanted)}); use --fresh to set the earlier '
        'run aside and prepare again, or another --workdir.')
  elif prepared is None and earlier:
    raise WorkdirError(
        f'{workdir.path} holds a run that does not say what it was prepared '
        'from; use --fresh to set it aside and start again, or another '
        '--workdir.')
  if data_dir:
    splits = parallel_text.load_local(
        files, languages, tfds_dir or workdir.path_of(workdir_lib.TFDS),
        content)
  else:
    splits = parallel_text.load_catalog(dataset, tfds_dir)
  texts = {split: parallel_text.pairs_of(data, languages)
           for split, data in splits.items()}
  if os.path.isfile(vocabulary + '.model'):
    tokenizer = spm_lib.load_tokenizer(vocabulary)
  else:
    train_src, train_tgt = texts['train']
    tokenizer = spm_lib.train_tokenizer(train_src + train_tgt, vocabulary,
                                        config)
  spm_lib.check_special_ids(tokenizer, config)
  workdir.write_json(workdir_lib.PREPARED, wanted)
  return texts, tokenizer


def _encode(tokenizer, texts: tuple[list[str], list[str]]):
  return tuple([np.asarray(ids, np.int32) for ids in tokenizer.encode(side)]
               for side in texts)


def run(config: TransformerConfig, workdir_path: str,
        data_dir: str | None = None, dataset: str | None = None,
        tfds_dir: str | None = None, fresh: bool = False,
        start_time: float | None = None) -> dict:
  """Trains and evaluates a translation model; writes WORKDIR/results.json.

  Data: local files (`data_dir`, e.g. Multi30k) or a prepared TFDS catalog
  `dataset` (one of the two). Resumes from WORKDIR/checkpoints when they
  hold a run of a compatible config; `fresh` first sets the earlier run
  aside.

  Raises:
    ConfigError, DataError, WorkdirError, CheckpointError: before anything
      compiles.
    loop.NonFinite, loop.Interrupted: see loop.train.
  """
  start_time = time.perf_counter() if start_time is None else start_time
  minutes = lambda: (time.perf_counter() - start_time) / 60
  check_config(config)
  with Workdir(workdir_path) as workdir, SignalCatcher() as signals:
    signals.when = 'while preparing the data'
    texts, tokenizer = prepare(config, workdir, data_dir, dataset, tfds_dir,
                               fresh)
    test_split = next((s for s in texts if s not in ('train', 'validation')),
                      'validation')
    rows = jax.device_count()
    train_pairs = batching.filter_pairs(*_encode(tokenizer, texts['train']),
                                        config.max_len)
    train_batches = batching.TokenBatches(
        train_pairs.src, train_pairs.tgt, config, config.tokens_per_batch,
        rows)
    val_pairs = batching.filter_pairs(
        *_encode(tokenizer, texts['validation']), config.max_len)
    val_batches = batching.TokenBatches(
        val_pairs.src, val_pairs.tgt, config, config.tokens_per_batch, rows,
        shuffle=False)
    held_out = [val_batches.make(members, length, val_batches.rows_of(length))
                for length, members in val_batches.epoch_batches()]
    print(f'train: {len(train_pairs.src)} pairs in {train_batches.per_epoch} '
          f'batches per epoch ({len(train_batches.shapes())} shapes); '
          f'skipped {train_pairs.empty} empty and {train_pairs.too_long} '
          f'longer than max_len={config.max_len}')

    parallel = DataParallel(config, config.parallel)
    training = TrainingRun.open(config, workdir, parallel)
    evaluations = []

    def bleu_on(params, split: str, beam_size: int) -> dict:
      sources, references = texts[split]
      started = time.perf_counter()
      hypotheses = translate_lines(params, config, tokenizer, sources,
                                   beam_size, config.eval_alpha)
      return {**evaluation.bleu(hypotheses, references),
              'beam_size': beam_size, 'sentences': len(sources),
              'seconds': time.perf_counter() - started}

    def evaluate(state: TrainState) -> tuple[float, bool]:
      # Only the parameters go to the devices; the optimizer state is not
      # needed. Greedy search keeps these evaluations cheap.
      loss = evaluation.held_out_loss(
          parallel, parallel.put_state(state.params), held_out)
      scores = bleu_on(state.params, 'validation', beam_size=1)
      evaluations.append({
          'step': int(state.step), 'wall_minutes': minutes(),
          'val_loss': loss['loss'], 'val_perplexity': loss['perplexity'],
          'val_bleu': scores['bleu'],
          'val_bleu_lowercase': scores['bleu_lowercase']})
      if training.log is not None:
        training.log.write('eval', evaluations[-1])
      tqdm.tqdm.write(
          f'step {int(state.step)} ({minutes():.1f} min): validation loss '
          f'{loss["loss"]:.3f}, perplexity {loss["perplexity"]:.2f}, greedy '
          f'BLEU {scores["bleu"]:.2f} (lowercased {scores["bleu_lowercase"]:.2f})')
      return scores['bleu'], False

    shard = (jax.process_index(), jax.process_count())
    try:
      state, history = training.train(
          lambda step: train_batches.batch_at(step, shard), evaluate, signals)
    finally:
      training.close(f'{config.src_lang} -> {config.tgt_lang} translation')
    signals.when = 'during the final evaluation'
    candidates = {'latest': state.params}
    averaged_steps = []
    if config.average_last > 1:
      with Checkpoints(workdir.path_of(workdir_lib.CHECKPOINTS)) as checkpoints:
        # A run its time budget ended early averages the checkpoints it
        # saved (its first log said so) rather than lose its final scores.
        last = min(config.average_last, len(checkpoints.steps()))
        if last < config.average_last:
          tqdm.tqdm.write(
              f'--average_last={config.average_last}: the run saved {last} '
              'checkpoint(s); ' + (f'averaging those {last}.' if last > 1 else
                                   'scoring the last parameters only.'))
        if last > 1:
          candidates['averaged'], averaged_steps = average_params(
              checkpoints, last, state.params)
    if averaged_steps and jax.process_index() == 0:
      with Checkpoints(workdir.path_of(workdir_lib.AVERAGED), keep=1,
                       writer=True) as averaged:
        averaged.save_params(int(state.step), candidates['averaged'], config,
                             {'averaged_steps': averaged_steps})
    validation = {name: bleu_on(params, 'validation', config.eval_beam_size)
                  for name, params in candidates.items()}
    chosen = max(validation, key=lambda name: validation[name]['bleu'])
    test = bleu_on(candidates[chosen], test_split, config.eval_beam_size)
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
        'vocabulary': {'path': workdir.path_of(workdir_lib.TOKENIZER) + '.model',
                       'size': tokenizer.get_piece_size(), 'type': 'unigram',
                       'joint': True},
        'devices': jax.device_count(),
        'steps': int(state.step),
        'epochs': int(state.step) / train_batches.per_epoch,
        'resumed_from': training.resumed_from,
        'final_loss': history[-1]['loss'] if history else None,
        'evaluations': evaluations,
        # Wall minutes (from the run's start) of the first evaluation whose
        # greedy validation BLEU, cased, reached each threshold.
        'minutes_to_val_bleu': {
            str(threshold): next((e['wall_minutes'] for e in evaluations
                                  if e['val_bleu'] >= threshold), None)
            for threshold in (25, 30, 35, 40)},
        'averaged_steps': averaged_steps,
        'validation': validation,
        'translate_with': chosen,
        'test_split': test_split,
        'test': test,
        'test_bleu': test['bleu'],
        'test_bleu_lowercase': test['bleu_lowercase'],
        'wall_seconds': time.perf_counter() - start_time,
        'history': history,
    }
    if jax.process_index() == 0:  # one writer in a multi-host run
      path = workdir.write_json(workdir_lib.RESULTS, results)
      if evaluations:
        plots.bleu_over_time(workdir.path)
      for name, scores in validation.items():
        print(f'validation, {name} parameters: sacreBLEU {scores["bleu"]:.2f} '
              f'(lowercased {scores["bleu_lowercase"]:.2f})')
      print(f'{test_split} with the {chosen} parameters: sacreBLEU '
            f'{test["bleu"]:.2f} ({test["signature"]}), lowercased '
            f'{test["bleu_lowercase"]:.2f} ({test["signature_lowercase"]}) '
            f'after {results["steps"]} steps, {results["wall_seconds"] / 60:.1f}'
            f' min; results in {path}')
  return results
