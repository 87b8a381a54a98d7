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
from flaxformer_mini.data import DataError, batching, parallel_text
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


def _readable_vocabulary(workdir: Workdir) -> bool:
  try:
    spm_lib.load_tokenizer(workdir.path_of(workdir_lib.TOKENIZER))
    return True
  except DataError:
    return False


def _check_prepared(workdir: Workdir, wanted: dict, fresh: bool) -> None:
  """Refuses a workdir prepared from something else (sets it aside: `fresh`).

  The same contents found at another path (the data folder moved, or is
  reached through a link) are the same data: the run goes on, with a note.
  """
  prepared = workdir.read_json(workdir_lib.PREPARED)
  earlier = (os.path.isfile(workdir.path_of(workdir_lib.TOKENIZER + '.model'))
             or os.path.isdir(workdir.path_of(workdir_lib.CHECKPOINTS)))
  if fresh:
    keep = _PREPARED if prepared == wanted and _readable_vocabulary(workdir) else ()
    if moved := workdir.set_aside(keep):
      print(f'--fresh: the earlier run is now in {moved}')
  elif prepared is not None and prepared != wanted:
    if {**prepared, 'source': wanted['source']} == wanted:
      print(f'the data moved from {prepared["source"]} to {wanted["source"]}'
            ' (the same contents); going on with it')
    else:
      raise WorkdirError(
          f'{workdir.path} was prepared from other data or settings ('
          f'{_differences(prepared, wanted)}); use --fresh to set the earlier '
          'run aside and prepare again, or another --workdir.')
  elif prepared is None and earlier:
    raise WorkdirError(
        f'{workdir.path} holds a run that does not say what it was prepared '
        'from; use --fresh to set it aside and start again, or another '
        '--workdir.')


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
    source = os.path.realpath(data_dir)
    content = parallel_text.fingerprint(files)
  else:
    source, content = f'tfds:{dataset}', dataset
  wanted = _wanted(config, source, content)
  _check_prepared(workdir, wanted, fresh)
  if data_dir:
    splits = parallel_text.load_local(
        files, languages, tfds_dir or workdir.path_of(workdir_lib.TFDS),
        content)
  else:
    splits = parallel_text.load_catalog(dataset, tfds_dir)
  texts = {split: parallel_text.pairs_of(data, languages)
           for split, data in splits.items()}
  vocabulary = workdir.path_of(workdir_lib.TOKENIZER)
  if os.path.isfile(vocabulary + '.model'):
    tokenizer = spm_lib.load_tokenizer(vocabulary)
  else:
    train_src, train_tgt = texts['train']
    tokenizer = spm_lib.train_tokenizer(train_src + train_tgt, vocabulary,
                                        config)
  spm_lib.check_special_ids(tokenizer, config)
  workdir.write_json(workdir_lib.PREPARED, wanted)
  return texts, tokenizer


@dataclasses.dataclass
class _Batches:
  """The token-budget batches of training and the held-out validation set."""
  train: batching.TokenBatches
  train_pairs: batching.Filtered
  held_out: list


def _encode(tokenizer, texts: tuple[list[str], list[str]]):
  return tuple([np.asarray(ids, np.int32) for ids in tokenizer.encode(side)]
               for side in texts)


def _token_batches(config: TransformerConfig, tokenizer, texts: dict
                   ) -> _Batches:
  """Encodes the training and validation splits into bucketed batches.

  Raises:
    DataError: no training pair fits in max_len.
  """
  rows = jax.device_count()
  train_pairs = batching.filter_pairs(*_encode(tokenizer, texts['train']),
                                      config.max_len)
  if not train_pairs.src:
    raise DataError(
        f'--max_len={config.max_len}: none of the {train_pairs.too_long} '
        'non-empty training pairs fits (source + eos and bos + target + eos '
        'within max_len tokens); raise --max_len.')
  train = batching.TokenBatches(train_pairs.src, train_pairs.tgt, config,
                                config.tokens_per_batch, rows)
  val_pairs = batching.filter_pairs(*_encode(tokenizer, texts['validation']),
                                    config.max_len)
  val = batching.TokenBatches(val_pairs.src, val_pairs.tgt, config,
                              config.tokens_per_batch, rows, shuffle=False)
  held_out = [val.make(members, length, val.rows_of(length))
              for length, members in val.epoch_batches()]
  print(f'train: {len(train_pairs.src)} pairs in {train.per_epoch} '
        f'batches per epoch ({len(train.shapes())} shapes); '
        f'skipped {train_pairs.empty} empty and {train_pairs.too_long} '
        f'longer than max_len={config.max_len}')
  return _Batches(train, train_pairs, held_out)


class _Evaluator:
  """Scores a run's parameters: held-out loss and sacreBLEU on a split."""

  def __init__(self, config: TransformerConfig, training: TrainingRun,
               tokenizer, texts: dict, held_out: list, start_time: float):
    self.config, self.training = config, training
    self.tokenizer, self.texts, self.held_out = tokenizer, texts, held_out
    self.start_time = start_time
    self.evaluations = []  # one record per evaluation during training

  def bleu(self, params, split: str, beam_size: int) -> dict:
    """sacreBLEU of `params`' translations of `split`, cased and lowercased."""
    sources, references = self.texts[split]
    started = time.perf_counter()
    hypotheses = translate_lines(params, self.config, self.tokenizer, sources,
                                 beam_size, self.config.eval_alpha)
    return {**evaluation.bleu(hypotheses, references),
            'beam_size': beam_size, 'sentences': len(sources),
            'seconds': time.perf_counter() - started}

  def __call__(self, state: TrainState) -> tuple[float, bool]:
    """The evaluation during training: validation loss and greedy BLEU."""
    # Only the parameters go to the devices; the optimizer state is not
    # needed. Greedy search keeps these evaluations cheap.
    parallel = self.training.parallel
    loss = evaluation.held_out_loss(parallel, parallel.replicate(state.params),
                                    self.held_out)
    scores = self.bleu(state.params, 'validation', beam_size=1)
    minutes = (time.perf_counter() - self.start_time) / 60
    record = {'step': int(state.step), 'wall_minutes': minutes,
              'val_loss': loss['loss'], 'val_perplexity': loss['perplexity'],
              'val_bleu': scores['bleu'],
              'val_bleu_lowercase': scores['bleu_lowercase']}
    self.evaluations.append(record)
    if self.training.log is not None:
      self.training.log.write('eval', record)
    tqdm.tqdm.write(
        f'step {record["step"]} ({minutes:.1f} min): validation loss '
        f'{loss["loss"]:.3f}, perplexity {loss["perplexity"]:.2f}, greedy '
        f'BLEU {scores["bleu"]:.2f} (lowercased {scores["bleu_lowercase"]:.2f})')
    return scores['bleu'], False


def _average_and_choose(config: TransformerConfig, workdir: Workdir,
                        state: TrainState, evaluator: _Evaluator) -> dict:
  """The last parameters and the average of the last checkpoints, each
  scored on validation with beam search; the better one is kept for the
  translate command.

  Returns {'candidates': {name: params}, 'averaged_steps', 'validation':
  {name: scores}, 'chosen': name}.
  """
  candidates, averaged_steps = {'latest': state.params}, []
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
  validation = {name: evaluator.bleu(params, 'validation',
                                     config.eval_beam_size)
                for name, params in candidates.items()}
  chosen = max(validation, key=lambda name: validation[name]['bleu'])
  return {'candidates': candidates, 'averaged_steps': averaged_steps,
          'validation': validation, 'chosen': chosen}


def _data_summary(data_dir: str | None, dataset: str | None, texts: dict,
                  batches: _Batches) -> dict:
  """results.json's account of the data: its pairs and what was used."""
  pairs = batches.train_pairs
  return {'data_dir': data_dir, 'dataset': dataset,
          'pairs': {split: len(texts[split][0]) for split in texts},
          'train_pairs_used': len(pairs.src),
          'train_skipped_empty': pairs.empty,
          'train_skipped_too_long': pairs.too_long,
          'batches_per_epoch': batches.train.per_epoch,
          'batch_shapes': sorted(batches.train.shapes())}


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
  check_config(config)
  with Workdir(workdir_path) as workdir, SignalCatcher() as signals:
    # Data and batches.
    signals.when = 'while preparing the data'
    texts, tokenizer = prepare(config, workdir, data_dir, dataset, tfds_dir,
                               fresh)
    test_split = next((s for s in texts if s not in ('train', 'validation')),
                      'validation')
    batches = _token_batches(config, tokenizer, texts)
    # Train.
    training = TrainingRun.open(config, workdir, DataParallel(config))
    evaluator = _Evaluator(config, training, tokenizer, texts,
                           batches.held_out, start_time)
    shard = (jax.process_index(), jax.process_count())
    try:
      state, history = training.train(
          lambda step: batches.train.batch_at(step, shard), evaluator, signals)
    finally:
      training.close(f'{config.src_lang} -> {config.tgt_lang} translation')
    # Average and choose; score.
    signals.when = 'during the final evaluation'
    final = _average_and_choose(config, workdir, state, evaluator)
    chosen = final['chosen']
    test = evaluator.bleu(final['candidates'][chosen], test_split,
                          config.eval_beam_size)
    # Results.
    evaluations = evaluator.evaluations
    results = training.results(
        'translate', state, history, start_time,
        data=_data_summary(data_dir, dataset, texts, batches),
        vocabulary={'path': workdir.path_of(workdir_lib.TOKENIZER) + '.model',
                    'size': tokenizer.get_piece_size(), 'type': 'unigram',
                    'joint': True},
        epochs=int(state.step) / batches.train.per_epoch,
        evaluations=evaluations,
        # Wall minutes (from the run's start) of the first evaluation whose
        # greedy validation BLEU, cased, reached each threshold.
        minutes_to_val_bleu={
            str(threshold): next((e['wall_minutes'] for e in evaluations
                                  if e['val_bleu'] >= threshold), None)
            for threshold in (25, 30, 35, 40)},
        averaged_steps=final['averaged_steps'],
        validation=final['validation'], translate_with=chosen,
        test_split=test_split, test=test, test_bleu=test['bleu'],
        test_bleu_lowercase=test['bleu_lowercase'])
    if path := training.write_results(results):
      if evaluations:
        plots.bleu_over_time(workdir.path)
      for name, scores in final['validation'].items():
        print(f'validation, {name} parameters: sacreBLEU {scores["bleu"]:.2f} '
              f'(lowercased {scores["bleu_lowercase"]:.2f})')
      print(f'{test_split} with the {chosen} parameters: sacreBLEU '
            f'{test["bleu"]:.2f} ({test["signature"]}), lowercased '
            f'{test["bleu_lowercase"]:.2f} ({test["signature_lowercase"]}) '
            f'after {results["steps"]} steps, {results["wall_seconds"] / 60:.1f}'
            f' min; results in {path}')
  return results
