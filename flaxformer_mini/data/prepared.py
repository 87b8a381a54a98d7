"""A corpus prepared once in a run's workdir: checked, vocabulary, tokenized.

`prepare(config, workdir, source, fresh)` is the one entry point. The first
run reads the whole corpus: it checks and fingerprints local files, prepares
them with TFDS, trains the joint SentencePiece vocabulary on a sample and
tokenizes the training and validation splits into WORKDIR/tokens. What it
is prepared from is recorded in WORKDIR/prepared.json before the vocabulary
is trained, and marked complete at the end: the same command finishes a
preparation that was interrupted (Ctrl-C, a full disk), whatever stage it
reached, keeping a vocabulary that reads back whole. A later start or
resume finds all of that (local files unchanged since: the same size,
modification time, inode and change time; else their contents are read and
compared) and reads only the small splits' texts, and a run with other
data, languages or vocabulary is refused (or, with --fresh, prepared again)
instead of training on stale data.
"""

import dataclasses
import os

import jax
import tqdm

from flaxformer_mini import disk, multihost
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.data import DataError, parallel_text, tokenized
from flaxformer_mini.data import tokenizer as spm_lib
from flaxformer_mini.workdir import Workdir, WorkdirError


@dataclasses.dataclass(frozen=True)
class Source:
  """Where the parallel text comes from: a folder of local files
  (`data_dir`, e.g. Multi30k) or a prepared TFDS catalog `dataset`, one of
  the two; `tfds_dir`: TFDS's data dir (default: WORKDIR/tfds for local
  files, TFDS's own otherwise)."""
  data_dir: str | None = None
  dataset: str | None = None
  tfds_dir: str | None = None


# What --fresh keeps when it was prepared from the same data and settings.
_PREPARED = (workdir_lib.TFDS, workdir_lib.TOKENS, workdir_lib.TOKENIZER +
             '.model', workdir_lib.TOKENIZER + '.vocab', workdir_lib.PREPARED)


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
  What an interrupted preparation left (of other data or settings, or
  written before preparations were recorded from their start) is set aside,
  with a note, and the preparation starts anew.
  """
  # A record written before a setting was recorded was made as its default.
  prepared = recorded and {
      key: recorded.get(key, _DEFAULTS.get(key)) for key in wanted}
  complete = recorded is None or recorded.get('complete', True)
  trained = os.path.isdir(workdir.path_of(workdir_lib.CHECKPOINTS))
  if fresh:
    keep = (_PREPARED if prepared == wanted and _readable_vocabulary(workdir)
            else ())
    if moved := workdir.set_aside(keep):
      print(f'--fresh: the earlier run is now in {moved}')
  elif prepared is not None and prepared != wanted:
    if {**prepared, 'source': wanted['source']} == wanted:
      print(f'the data moved from {prepared["source"]} to {wanted["source"]}'
            ' (the same contents); going on with it')
    elif not complete and not trained:
      _set_aside_preparation(workdir, 'an interrupted preparation of other '
                             f'data or settings ({_differences(prepared, wanted)})')
    else:
      raise WorkdirError(
          f'{workdir.path} was prepared from other data or settings ('
          f'{_differences(prepared, wanted)}); use --fresh to set the earlier '
          'run aside and prepare again, or another --workdir.')
  elif prepared is None and trained:
    raise WorkdirError(
        f'{workdir.path} holds a run that does not say what it was prepared '
        'from; use --fresh to set it aside and start again, or another '
        '--workdir.')
  elif prepared is None:
    _set_aside_preparation(workdir, 'an interrupted preparation that did not '
                           'record what it was prepared from')


def _set_aside_preparation(workdir: Workdir, what: str) -> None:
  """Moves what a preparation wrote (and only that) into set-aside-<time>/."""
  others = set(os.listdir(workdir.path)) - set(_PREPARED)
  if moved := workdir.set_aside(keep=others):
    print(f'{what} is now in {moved}; preparing anew')


def _vocabulary(workdir: Workdir, splits: dict, config: TransformerConfig,
                complete: bool):
  """The run's SentencePiece model: trained once, then loaded.

  One that an interrupted preparation left cut short is trained again; a
  complete preparation's is never replaced (DataError names it instead).
  """
  vocabulary = workdir.path_of(workdir_lib.TOKENIZER)
  if os.path.isfile(vocabulary + '.model'):
    if complete or _readable_vocabulary(workdir):
      return spm_lib.load_tokenizer(vocabulary)
    print(f'{vocabulary}.model was left cut short; training it again')
  languages = (config.src_lang, config.tgt_lang)
  return spm_lib.train_tokenizer(
      spm_lib.sample_sentences(splits['train'], languages, config),
      vocabulary, config)


@dataclasses.dataclass
class Prepared:
  """A prepared corpus: the vocabulary, the tokenized training and
  validation splits (memory-mapped), and the texts of every split but
  training ({split: (sources, references)}, for BLEU)."""
  tokenizer: spm_lib.spm.SentencePieceProcessor
  train: tokenized.TokenizedSplit
  validation: tokenized.TokenizedSplit
  texts: dict[str, tuple[list[str], list[str]]]


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
  return tokenized.TokenizedSplit(directory, split, vocab_size)


def _prepare_here(config: TransformerConfig, workdir: Workdir,
                  source: Source, fresh: bool) -> Prepared:
  languages = (config.src_lang, config.tgt_lang)
  recorded = workdir.read_json(workdir_lib.PREPARED)
  if source.data_dir:
    files = parallel_text.find_split_files(source.data_dir, languages)
    origin = os.path.realpath(source.data_dir)
    content, stats = _local_content(recorded, files, origin)
  else:
    origin, content, stats = f'tfds:{source.dataset}', source.dataset, None
  wanted = _wanted(config, origin, content)
  _check_prepared(workdir, recorded, wanted, fresh)
  recorded = workdir.read_json(workdir_lib.PREPARED)  # after --fresh
  complete = recorded is not None and recorded.get('complete', True)
  if not complete:
    if recorded is not None:
      print('finishing the preparation that was interrupted')
    # Recorded before anything is made from it, so that a preparation that
    # is interrupted is finished by the same command.
    workdir.write_json(workdir_lib.PREPARED,
                       {**wanted, 'files': stats, 'complete': False})
  if source.data_dir:
    splits = parallel_text.load_local(
        files, languages,
        source.tfds_dir or workdir.path_of(workdir_lib.TFDS), content)
  else:
    splits = parallel_text.load_catalog(source.dataset, source.tfds_dir)
  tokenizer = _vocabulary(workdir, splits, config, complete)
  spm_lib.check_special_ids(tokenizer, config)
  directory = workdir.path_of(workdir_lib.TOKENS)
  train, validation = (
      _tokenize(splits, split, languages, tokenizer, directory,
                config.src_vocab_size) for split in ('train', 'validation'))
  workdir.write_json(workdir_lib.PREPARED, {
      **wanted, 'files': stats, 'complete': True,
      'vocab_sample_pairs': spm_lib.sample_size(config, len(train))})
  texts = {split: parallel_text.pairs_of(data, languages)
           for split, data in splits.items() if split != 'train'}
  return Prepared(tokenizer, train, validation, texts)


def _prepare_here_or_say_the_disk_is_full(
    config: TransformerConfig, workdir: Workdir, source: Source,
    fresh: bool) -> Prepared:
  try:
    return _prepare_here(config, workdir, source, fresh)
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, disk.DiskFull) or not disk.is_full(e):
      raise
    raise disk.DiskFull(
        f'no space left on the disk of {workdir.path} (while preparing the '
        'data); free some and run the same command again: the preparation '
        'goes on where it stopped.') from None


def prepare(config: TransformerConfig, workdir: Workdir, source: Source,
            fresh: bool = False) -> Prepared:
  """The corpus, its vocabulary and its tokenized splits, prepared once.

  See the module's docstring. `fresh` sets an earlier run aside first
  (keeping what was prepared from the same data and settings). In a
  multi-host run process 0 prepares first and the others after it, so a
  workdir on a shared disk is prepared once.

  Raises:
    DataError: the data cannot be read or makes no vocabulary of that size.
    WorkdirError: the workdir was prepared from something else (without
      `fresh`).
    disk.DiskFull: the disk filled up; the same command, with room, goes on
      where the preparation stopped.
    multihost.MultihostError: another process failed to prepare it.
  """
  return multihost.process_0_first(
      lambda: _prepare_here_or_say_the_disk_is_full(
          config, workdir, source, fresh and jax.process_index() == 0),
      'preparing the data')


