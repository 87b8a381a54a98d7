"""The translate command: a trained workdir turns sentences into translations.

  python -m flaxformer_mini.translate --workdir runs/translate < input.txt
  python -m flaxformer_mini.translate --workdir runs/translate --input in.txt

Reads the config and the SentencePiece model from the workdir, and the
parameters the run chose for translation (the averaged or the last
checkpoint, whichever scored better on validation; `--params` picks one).
Lines are split on '\\n' alone, sorted by length into batches and
beam-searched; line i of the output always answers line i of the input, and
an empty input line gives an empty output line.
"""

import os
import sys

from flaxformer_mini import cli, compilation_cache
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.checkpoints import CheckpointError
from flaxformer_mini.data import DataError
from flaxformer_mini.decoding import translate_lines


def split_lines(data: bytes, source: str) -> list[str]:
  """UTF-8 bytes -> their lines, split on '\\n' only (a final one ends the text).

  Other characters Python's str.splitlines() breaks at (U+2028, NEL, form
  feed, ...) stay inside their line, so line i of the output answers line i
  of the input. Raises ValueError naming the line that is not UTF-8.
  """
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b'\n') + 1
    raise ValueError(f'{source}: line {line} is not UTF-8 text.') from None
  lines = text.split('\n')
  if lines and lines[-1] == '':
    lines.pop()
  return [line.removesuffix('\r') for line in lines]


def main(argv: list[str]) -> None:
  parser = cli.OneLineParser(prog='python -m flaxformer_mini.translate',
                          description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--input', help='a UTF-8 text file (default: stdin).')
  parser.add_argument('--params', choices=['best', 'latest', 'averaged'],
                      default='best', help="the run's choice (default), its "
                      'latest checkpoint, or its averaged parameters.')
  parser.add_argument('--beam_size', type=cli.positive_int, default=4)
  parser.add_argument('--alpha', type=cli.finite_float,
                      help="length-penalty exponent (default: the run's "
                      'eval_alpha, the one its scores were decoded with).')
  parser.add_argument('--batch_size', type=cli.positive_int, default=64,
                      help='sentences per search.')
  compilation_cache.add_flag(parser)
  args = parser.parse_args(argv)
  if args.input is not None and not os.path.isfile(args.input):
    parser.error(f'--input={args.input}: '
                 + ('a folder, not a file.' if os.path.isdir(args.input) else
                    'no such file.'))
  if not os.path.isfile(os.path.join(args.workdir,
                                     workdir_lib.TOKENIZER + '.model')):
    parser.error(f'--workdir={args.workdir}: no {workdir_lib.TOKENIZER}.model '
                 'there; train with train.py --task=translate first.')
  try:
    if args.input is None:
      lines = split_lines(sys.stdin.buffer.read(), 'stdin')
    else:
      with open(args.input, 'rb') as f:
        lines = split_lines(f.read(), f'--input={args.input}')
  except ValueError as e:
    parser.error(str(e))
  compilation_cache.use(args.compilation_cache)
  try:
    run = workdir_lib.load_run(args.workdir, args.params)
  except (CheckpointError, DataError, workdir_lib.WorkdirError) as e:
    parser.error(str(e))
  config = run.config
  warn = lambda number, length: print(
      f'translate: line {number} has {length} tokens; cut to '
      f'{config.max_len - 1} (the model\'s max_len)', file=sys.stderr)
  translations = translate_lines(
      run.params, config, run.tokenizer, lines, args.beam_size,
      config.eval_alpha if args.alpha is None else args.alpha,
      args.batch_size, warn)
  sys.stdout.write(''.join(line + '\n' for line in translations))


if __name__ == '__main__':
  main(sys.argv[1:])
