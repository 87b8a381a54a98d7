"""The translate command: a trained workdir turns sentences into translations.

  python -m flaxformer_mini.translate --workdir runs/translate < input.txt
  python -m flaxformer_mini.translate --workdir runs/translate --input in.txt

Reads the config and the SentencePiece model from the workdir and the
parameters from its latest checkpoint (or `--params averaged` after
`python -m flaxformer_mini.checkpoints average`). Lines are batched by length
and beam-searched; line i of the output always answers line i of the input,
and an empty input line gives an empty output line.
"""

import argparse
import functools
import os
import sys

import jax
import numpy as np

from flaxformer_mini import checkpoints as ckpt
from flaxformer_mini import decoding
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.data.tokenizer import load_tokenizer

TOKENIZER_NAME = 'spm'


def tokenizer_path(workdir: str) -> str:
  return os.path.join(workdir, TOKENIZER_NAME)


def read_config(workdir: str) -> TransformerConfig:
  """The config the workdir's run was trained with (from its checkpoint)."""
  directory = os.path.join(workdir, 'checkpoints')
  checkpoints = ckpt.Checkpoints(directory)
  step = checkpoints.latest_step()
  if step is None:
    raise ckpt.CheckpointError(f'{directory}: no checkpoint to translate with.')
  return TransformerConfig(**checkpoints.read_meta(step)['config'])


def translate_lines(params, config: TransformerConfig, tokenizer,
                    lines: list[str], beam_size: int = 4, alpha: float = 0.6,
                    batch_size: int = 64, warn=None) -> list[str]:
  """Beam-search translations of `lines`, in order; '' for an empty line.

  Lines are sorted by length into batches of `batch_size` so that padding
  stays small; batch shapes are rounded up to multiples of 8 to bound the
  number of compiled programs. Sources longer than config.max_len - 1
  tokens are cut there (and reported through `warn(line_number, length)`).
  """
  encoded = [tokenizer.encode(line.strip()) if line.strip() else []
             for line in lines]
  limit = config.max_len - 1  # room for eos
  for number, ids in enumerate(encoded, start=1):
    if len(ids) > limit and warn is not None:
      warn(number, len(ids))
  order = sorted((i for i, ids in enumerate(encoded) if ids),
                 key=lambda i: len(encoded[i]))
  decode = jax.jit(functools.partial(decoding.beam_decode, config=config,
                                     beam_size=beam_size, alpha=alpha),
                   static_argnames=('max_len',))
  outputs = [''] * len(lines)
  for start in range(0, len(order), batch_size):
    members = order[start:start + batch_size]
    longest = min(max(len(encoded[i]) for i in members) + 1, config.max_len)
    length = min(-(-longest // 8) * 8, config.max_len)
    src = np.full((batch_size, length), config.pad_id, np.int32)
    for row, i in enumerate(members):
      ids = list(encoded[i][:limit]) + [config.eos_id]
      src[row, :len(ids)] = ids
    result = decode(params, src,
                    max_len=decoding.default_max_len(config, length))
    for row, i in enumerate(members):
      tokens = np.asarray(result.sequences[row, 0])
      tokens = tokens[:int(result.lengths[row, 0])].tolist()
      if tokens and tokens[-1] == config.eos_id:
        tokens = tokens[:-1]
      outputs[i] = tokenizer.decode(tokens)
  return outputs


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(prog='python -m flaxformer_mini.translate',
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--input', help='a text file (default: stdin).')
  parser.add_argument('--params', choices=['latest', 'averaged'],
                      default='latest')
  parser.add_argument('--beam_size', type=int, default=4)
  parser.add_argument('--alpha', type=float, default=0.6)
  parser.add_argument('--batch_size', type=int, default=64)
  args = parser.parse_args(argv)
  if not os.path.isfile(tokenizer_path(args.workdir) + '.model'):
    parser.error(f'--workdir={args.workdir}: no {TOKENIZER_NAME}.model '
                 'there; train with train.py --task=translate first.')
  try:
    config = read_config(args.workdir)
    source = os.path.join(args.workdir, 'averaged' if args.params == 'averaged'
                          else 'checkpoints')
    params = ckpt.load_params(source, config)
  except ckpt.CheckpointError as e:
    parser.error(str(e))
  if args.input:
    with open(args.input, encoding='utf-8') as f:
      lines = f.read().splitlines()
  else:
    lines = sys.stdin.read().splitlines()
  warn = lambda number, length: print(
      f'translate: line {number} has {length} tokens; cut to '
      f'{config.max_len - 1} (--max_len of the model)', file=sys.stderr)
  for line in translate_lines(params, config, load_tokenizer(
      tokenizer_path(args.workdir)), lines, args.beam_size, args.alpha,
                              args.batch_size, warn):
    print(line)


if __name__ == '__main__':
  main(sys.argv[1:])
