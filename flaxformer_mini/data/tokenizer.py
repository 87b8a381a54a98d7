"""A joint SentencePiece vocabulary for source and target (Section 5.1).

One model is trained on both sides of the training split, so the source and
target share ids and the model can share its embeddings. The special ids come
from the config: pad, bos and eos as configured, unk right after them.
"""

import os
import re
from typing import Iterable

import numpy as np
import sentencepiece as spm

from flaxformer_mini import disk
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.data import DataError, tokenized


# The pairs a vocabulary is trained on when config.vocab_sample is 0: enough
# for a 32k vocabulary, a bounded cost for any corpus.
DEFAULT_SAMPLE = 1_000_000


def sample_size(config: TransformerConfig, pairs: int) -> int:
  """The training pairs the vocabulary is trained on.

  Raises:
    DataError: --vocab_sample is larger than the training split.
  """
  if config.vocab_sample > pairs:
    raise DataError(
        f'--vocab_sample={config.vocab_sample}: more than the {pairs} '
        'training pairs; lower it, or 0 for all of them (up to '
        f'{DEFAULT_SAMPLE:,}).')
  return config.vocab_sample or min(pairs, DEFAULT_SAMPLE)


def sample_sentences(source, languages: tuple[str, str],
                     config: TransformerConfig) -> list[str]:
  """Both sides of a seeded random sample of a TFDS data source's pairs
  (all of them, in order, where the sample is the whole split)."""
  count = sample_size(config, len(source))
  chosen = (np.arange(count) if count == len(source) else np.sort(
      np.random.default_rng(config.seed).choice(len(source), count,
                                                replace=False)))
  sides = ([], [])
  for texts in tokenized.source_texts(source, chosen.tolist(), languages):
    for side, text in zip(sides, texts):
      side += text
  return sides[0] + sides[1]


def train_tokenizer(sentences: Iterable[str], path: str,
                    config: TransformerConfig) -> spm.SentencePieceProcessor:
  """Trains a unigram model of config.src_vocab_size pieces into `path`.model.

  Raises:
    DataError: the training text cannot make that many pieces.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  sentences = list(sentences)
  if not any(sentence.strip() for sentence in sentences):
    raise DataError('the training split has no text (every sentence is '
                    'empty): SentencePiece has nothing to learn from.')
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=path,
        vocab_size=config.src_vocab_size, model_type='unigram',
        character_coverage=1.0, pad_id=config.pad_id, bos_id=config.bos_id,
        eos_id=config.eos_id, unk_id=config.first_ordinary_id,
        input_sentence_size=2_000_000, shuffle_input_sentence=True,
        minloglevel=2)
  except RuntimeError as e:
    most = re.search(r'value <= (\d+)', str(e))
    if not most:
      raise
    raise DataError(
        f'--src_vocab_size={config.src_vocab_size} is more pieces than '
        f'SentencePiece can make of this training text (at most '
        f'{most.group(1)}); lower --src_vocab_size and --tgt_vocab_size.'
    ) from None
  try:
    return load_tokenizer(path)
  except DataError:
    # SentencePiece writes a model cut short on a full disk without a word:
    # remove it, so that the next run trains it again.
    for suffix in ('.model', '.vocab'):
      if os.path.exists(path + suffix):
        os.remove(path + suffix)
    folder = os.path.dirname(os.path.abspath(path))
    if disk.free_bytes(folder) < 1 << 20:
      raise disk.DiskFull(
          f'no space left on the disk of {folder} (while writing the '
          'vocabulary); free some and run the same command again: the '
          'preparation goes on where it stopped.') from None
    raise DataError(f'{path}.model was written cut short; run the same '
                    'command again to train it anew.') from None


def load_tokenizer(path: str) -> spm.SentencePieceProcessor:
  """The SentencePiece model `path`.model.

  Raises:
    DataError: the file is damaged (cut short by a crash or an interrupted
      copy), naming it.
  """
  try:
    return spm.SentencePieceProcessor(model_file=f'{path}.model')
  except (RuntimeError, OSError) as e:
    raise DataError(
        f'{path}.model is damaged ({str(e).strip().splitlines()[0][:100]}); '
        'restore it from a copy of the run, or start over with --fresh '
        '(which sets the run aside).') from None


def check_special_ids(tokenizer: spm.SentencePieceProcessor,
                      config: TransformerConfig) -> None:
  """Raises DataError where the vocabulary has other special ids or size."""
  found = (tokenizer.pad_id(), tokenizer.bos_id(), tokenizer.eos_id(),
           tokenizer.get_piece_size())
  wanted = (config.pad_id, config.bos_id, config.eos_id, config.src_vocab_size)
  if found != wanted:
    raise DataError(
        f'the SentencePiece model has (pad, bos, eos, size) = {found} but the '
        f'config asks for {wanted}; use --fresh to prepare it again, or '
        'matching flags.')
