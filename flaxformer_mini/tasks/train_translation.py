"""Translation on real parallel text: data, vocabulary, training, averaging, BLEU.

`run` prepares the data once (local files through the project's TFDS builder,
or a prepared TFDS catalog dataset; a joint SentencePiece vocabulary trained
on a seeded sample; the training and validation splits tokenized into
WORKDIR/tokens), trains with token-budget batches made ahead by the loop's
input pipeline, evaluates every `eval_every` steps (validation loss and
perplexity, and greedy BLEU on the whole validation split, against the
minutes since the run started), and at the end averages the last
`average_last` checkpoints, scores both the last and the averaged parameters
on validation with beam search, keeps the better one for the translate
command and scores it once on the test split.

What is prepared (WORKDIR/tfds, tokens, spm.model) is recorded in
prepared.json with what it was prepared from; a later run with other data,
languages or vocabulary is refused (or, with --fresh, prepares again)
instead of training on stale data.
"""

import dataclasses
import os
import time

import jax
import tqdm
from jax.experimental import multihost_utils

from flaxformer_mini import evaluation, plots
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.checkpoints import Checkpoints, average_params
from flaxformer_mini.config import ConfigError, TransformerConfig
from flaxformer_mini.data import DataError, batching, parallel_text, tokenized
from flaxformer_mini.data import tokenizer as spm_lib
from flaxformer_mini.decoding import translate_lines
from flaxformer_mini.loop import SignalCatcher, TrainingRun
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.training import TrainState
from flaxformer_mini.workdir import Workdir, WorkdirError

# What --fresh keeps when it was prepared from the same data and settings.
_PREPARED = (workdir_lib.TFDS, workdir_lib.TOKENS, workdir_lib.TOKENIZER +
             '.model', workdir_lib.TOKENIZER + '.vocab', workdir_lib.PREPARED)


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
  rows = devices * config.grad_accumulation
  if config.tokens_per_batch < config.max_len * rows:
    raise ConfigError(
        f'grad_accumulation={config.grad_accumulation}: '
        f'tokens_per_batch={config.tokens_per_batch} holds no batch of '
        f'{rows} rows ({devices} device(s) x {config.grad_accumulation} '
        f'micro-batches) of length max_len={config.max_len}; lower it, or '
        f'raise tokens_per_batch to at least {config.max_len * rows}.')
  if config.average_last > config.keep_checkpoints:
    raise ConfigError(
        f'average_last={config.average_last}: the run keeps only the last '
        f'keep_checkpoints={config.keep_checkpoints}; raise keep_checkpoints '
        'or average fewer.')


# Settings of the prepared data recorded since the first version, and what
# earlier records were made with.
_DEFAULTS = {'vocab_sample': 0, 'seed': 0}


def _wanted(config: TransformerConfig, source: str, content: str) -> dict:
  """What the prepared data and vocabulary of this run are made from."""
  return {'source': source, 'content': content,
          'languages': [config.src_lang, config.tgt_lang],
          'vocab_size': config.src_vocab_size,
          'vocab_sample': config.vocab_sample, 'seed': config.seed,
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


def _check_prepared(workdir: Workdir, recorded: dict | None, wanted: dict,
                    fresh: bool) -> None:
  """Refuses a workdir prepared from something else (sets it aside: `fresh`).

  The same contents found at another path (the data folder moved, or is
  reached through a link) are the same data: the run goes on, with a note.
  """
  # A record written before a setting was recorded was made as its default.
  prepared = recorded and {
      key: recorded.get(key, _DEFAULTS.get(key)) for key in wanted}
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


@dataclasses.dataclass
class _Data:
  """A prepared corpus: the vocabulary, the tokenized training and
  validation splits (memory-mapped), and the texts of every split but
  training (sources and references, for BLEU)."""
  tokenizer: object
  train: tokenized.TokenizedSplit
  validation: tokenized.TokenizedSplit
  texts: dict


def _local_content(recorded: dict | None, files: dict, source: str
                   ) -> tuple[str, dict]:
  """(fingerprint, file stats) of local files: read whole unless the
  workdir's record shows them unchanged since they were prepared."""
  stats = parallel_text.file_stats(files)
  recorded = recorded or {}
  if recorded.get('source') == source and recorded.get('files') == stats:
    return recorded['content'], stats
  parallel_text.check_split_files(files)
  return parallel_text.fingerprint(files), stats


def _tokenize(splits: dict, split: str, languages: tuple[str, str], tokenizer,
              directory: str, vocab_size: int) -> tokenized.TokenizedSplit:
  """The tokenized `split`, written first if it is not complete."""
  if not tokenized.is_complete(directory, split):
    source = splits[split]
    with tqdm.tqdm(total=len(source), unit='pair', dynamic_ncols=True,
                   desc=f'tokenizing {split} (once)') as progress:
      def counted(chunks):
        for chunk in chunks:
          progress.update(len(chunk[0]))
          yield chunk
      tokenized.write_split(directory, split, counted(
          tokenized.encoded_chunks(source, languages, tokenizer)), vocab_size)
  return tokenized.TokenizedSplit(directory, split)


def _prepare_here(config: TransformerConfig, workdir: Workdir,
                  data_dir: str | None, dataset: str | None,
                  tfds_dir: str | None, fresh: bool) -> _Data:
  languages = (config.src_lang, config.tgt_lang)
  recorded = workdir.read_json(workdir_lib.PREPARED)
  if data_dir:
    files = parallel_text.find_split_files(data_dir, languages)
    source = os.path.realpath(data_dir)
    content, stats = _local_content(recorded, files, source)
  else:
    source, content, stats = f'tfds:{dataset}', dataset, None
  wanted = _wanted(config, source, content)
  _check_prepared(workdir, recorded, wanted, fresh)
  if data_dir:
    splits = parallel_text.load_local(
        files, languages, tfds_dir or workdir.path_of(workdir_lib.TFDS),
        content)
  else:
    splits = parallel_text.load_catalog(dataset, tfds_dir)
  vocabulary = workdir.path_of(workdir_lib.TOKENIZER)
  if os.path.isfile(vocabulary + '.model'):
    tokenizer = spm_lib.load_tokenizer(vocabulary)
  else:
    tokenizer = spm_lib.train_tokenizer(
        spm_lib.sample_sentences(splits['train'], languages, config),
        vocabulary, config)
  spm_lib.check_special_ids(tokenizer, config)
  directory = workdir.path_of(workdir_lib.TOKENS)
  train, validation = (
      _tokenize(splits, split, languages, tokenizer, directory,
                config.src_vocab_size) for split in ('train', 'validation'))
  workdir.write_json(workdir_lib.PREPARED, {
      **wanted, 'files': stats,
      'vocab_sample_pairs': spm_lib.sample_size(config, len(train))})
  texts = {split: parallel_text.pairs_of(data, languages)
           for split, data in splits.items() if split != 'train'}
  return _Data(tokenizer, train, validation, texts)


def prepare(config: TransformerConfig, workdir: Workdir, data_dir: str | None,
            dataset: str | None, tfds_dir: str | None, fresh: bool) -> _Data:
  """The corpus, its vocabulary and its tokenized splits, prepared once.

  The first run reads the whole corpus: it checks and fingerprints local
  files, prepares them with TFDS, trains the vocabulary on a sample and
  tokenizes the training and validation splits into WORKDIR/tokens. A later
  start or resume finds all of that (local files unchanged since: same size
  and modification time) and reads only the small splits' texts. In a
  multi-host run process 0 prepares first and the others after it, so a
  workdir on a shared disk is prepared once.

  Raises:
    DataError: the data cannot be read or makes no vocabulary of that size.
    WorkdirError: the workdir was prepared from something else (without
      `fresh`).
  """
  data = None
  for turn in ('process 0', 'the other processes'):
    if (jax.process_index() == 0) == (turn == 'process 0'):
      data = _prepare_here(config, workdir, data_dir, dataset, tfds_dir,
                           fresh and jax.process_index() == 0)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'data prepared by {turn}')
  return data


@dataclasses.dataclass
class _Batches:
  """The token-budget batches of training and the held-out validation set."""
  train: batching.TokenBatches
  held_out: list


def _token_batches(config: TransformerConfig, data: _Data) -> _Batches:
  """The training split's bucketed batches and the validation batches.

  Raises:
    DataError: no training pair fits in max_len.
  """
  rows = jax.device_count() * config.grad_accumulation
  train = batching.TokenBatches(data.train, config, config.tokens_per_batch,
                                rows)
  if not train.used:
    raise DataError(
        f'--max_len={config.max_len}: none of the {train.too_long} '
        'non-empty training pairs fits (source + eos and bos + target + eos '
        'within max_len tokens); raise --max_len.')
  val = batching.TokenBatches(data.validation, config,
                              config.tokens_per_batch, jax.device_count(),
                              shuffle=False)
  held_out = [val.make(members, length, val.rows_of(length))
              for length, members in val.epoch_batches()]
  print(f'train: {train.used} pairs in {train.per_epoch} '
        f'batches per epoch ({len(train.shapes())} shapes); '
        f'skipped {train.empty} empty and {train.too_long} '
        f'longer than max_len={config.max_len}')
  return _Batches(train, held_out)


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


def _data_summary(data_dir: str | None, dataset: str | None, data: _Data,
                  batches: _Batches) -> dict:
  """results.json's account of the data: its pairs and what was used."""
  train = batches.train
  return {'data_dir': data_dir, 'dataset': dataset,
          'pairs': {'train': len(data.train),
                    **{split: len(data.texts[split][0])
                       for split in data.texts}},
          'train_pairs_used': train.used,
          'train_skipped_empty': train.empty,
          'train_skipped_too_long': train.too_long,
          'batches_per_epoch': train.per_epoch,
          'batch_shapes': sorted(train.shapes())}


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
    data = prepare(config, workdir, data_dir, dataset, tfds_dir, fresh)
    tokenizer = data.tokenizer
    test_split = next((s for s in data.texts if s != 'validation'),
                      'validation')
    batches = _token_batches(config, data)
    # Train.
    training = TrainingRun.open(config, workdir, DataParallel(config))
    evaluator = _Evaluator(config, training, tokenizer, data.texts,
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
        data=_data_summary(data_dir, dataset, data, batches),
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
