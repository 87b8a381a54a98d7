"""A joint SentencePiece vocabulary for source and target (Section 5.1).

One model is trained on both sides of the training split, so the source and
target share ids and the model can share its embeddings. The special ids come
from the config: pad, bos and eos as configured, unk right after them.
"""

import os
from typing import Iterable

import sentencepiece as spm

from flaxformer_mini.config import TransformerConfig


def unk_id(config: TransformerConfig) -> int:
  return max(config.pad_id, config.bos_id, config.eos_id) + 1


def train_tokenizer(sentences: Iterable[str], path: str,
                    config: TransformerConfig) -> spm.SentencePieceProcessor:
  """Trains a unigram model of config.src_vocab_size pieces into `path`.model."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences), model_prefix=path,
      vocab_size=config.src_vocab_size, model_type='unigram',
      character_coverage=1.0, pad_id=config.pad_id, bos_id=config.bos_id,
      eos_id=config.eos_id, unk_id=unk_id(config),
      input_sentence_size=2_000_000, shuffle_input_sentence=True,
      minloglevel=2)
  return load_tokenizer(path)


def load_tokenizer(path: str) -> spm.SentencePieceProcessor:
  return spm.SentencePieceProcessor(model_file=f'{path}.model')


def check_special_ids(tokenizer: spm.SentencePieceProcessor,
                      config: TransformerConfig) -> None:
  """A vocabulary trained for other ids or another size is refused."""
  found = (tokenizer.pad_id(), tokenizer.bos_id(), tokenizer.eos_id(),
           tokenizer.get_piece_size())
  wanted = (config.pad_id, config.bos_id, config.eos_id, config.src_vocab_size)
  if found != wanted:
    raise ValueError(
        f'the SentencePiece model has (pad, bos, eos, size) = {found}, the '
        f'config {wanted}; use a fresh --workdir or matching flags.')
