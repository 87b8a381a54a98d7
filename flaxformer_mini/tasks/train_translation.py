"""Translation on real parallel text: batches, training, averaging, BLEU.

`run` prepares the data once (data/prepared.py: local files through the
project's TFDS builder, or a prepared TFDS catalog dataset; a joint
SentencePiece vocabulary; the training and validation splits tokenized into
WORKDIR/tokens), trains with token-budget batches made ahead by the loop's
input pipeline, evaluates every `eval_every` steps (validation loss and
perplexity, and greedy BLEU on the whole validation split, against the
minutes since the run started), and at the end averages the last
`average_last` checkpoints, scores both the last and the averaged parameters
on validation with beam search, keeps the better one for the translate
command and scores it once on the test split.
"""

import dataclasses
import time

import jax
import tqdm

from flaxformer_mini import evaluation, plots
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.checkpoints import Checkpoints, average_params
from flaxformer_mini.config import ConfigError, TransformerConfig
from flaxformer_mini.data import DataError, batching
from flaxformer_mini.data.prepared import Prepared, Source, prepare
from flaxformer_mini.translation import translate_lines
from flaxformer_mini.loop import SignalCatcher
from flaxformer_mini.parallel import DataParallel, rows_per_update
from flaxformer_mini.run import TrainingRun
from flaxformer_mini.training import TrainState
from flaxformer_mini.workdir import Workdir

def check_config(config: TransformerConfig) -> None:
  """Translation's own fields, checked before any data is read.

  Raises:
    ConfigError: naming the field.
  """
  if config.src_lang == config.tgt_lang:
    raise ConfigError(f'src_lang={config.src_lang}: the same as tgt_lang.')
  batching.check_budget(config.tokens_per_batch, config.max_len,
                        rows_per_update(config))
  if config.average_last > config.keep_checkpoints:
    raise ConfigError(
        f'average_last={config.average_last}: the run keeps only the last '
        f'keep_checkpoints={config.keep_checkpoints}; raise keep_checkpoints '
        'or average fewer.')


@dataclasses.dataclass
class _Batches:
  """The token-budget batches of training and the held-out validation set."""
  train: batching.TokenBatches
  held_out: list


def _token_batches(config: TransformerConfig, data: Prepared) -> _Batches:
  """The training split's bucketed batches and the validation batches.

  Raises:
    DataError: no training pair fits in max_len.
  """
  train = batching.TokenBatches(data.train, config, config.tokens_per_batch,
                                rows_per_update(config))
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
                                 beam_size=beam_size)
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


def _data_summary(source: Source, data: Prepared, batches: _Batches) -> dict:
  """results.json's account of the data: its pairs and what was used."""
  train = batches.train
  return {'data_dir': source.data_dir, 'dataset': source.dataset,
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
    source = Source(data_dir, dataset, tfds_dir)
    data = prepare(config, workdir, source, fresh)
    tokenizer = data.tokenizer
    test_split = next((s for s in data.texts if s != 'validation'),
                      'validation')
    batches = _token_batches(config, data)
    # Train.
    training = TrainingRun.open('translate', config, workdir,
                                DataParallel(config))
    evaluator = _Evaluator(config, training, tokenizer, data.texts,
                           batches.held_out, start_time)
    shard = (jax.process_index(), jax.process_count())
    with training.closing(
        f'{config.src_lang} -> {config.tgt_lang} translation'):
      state, history = training.train(
          lambda step: batches.train.batch_at(step, shard), evaluator, signals)
    # Average and choose; score.
    signals.when = 'during the final evaluation'
    final = _average_and_choose(config, workdir, state, evaluator)
    chosen = final['chosen']
    test = evaluator.bleu(final['candidates'][chosen], test_split,
                          config.eval_beam_size)
    # Results.
    evaluations = evaluator.evaluations
    results = training.results(
        state, history, start_time,
        data=_data_summary(source, data, batches),
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
