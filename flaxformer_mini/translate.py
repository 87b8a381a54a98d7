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

import argparse
import math
import os
import sys

import jax
import numpy as np

from flaxformer_mini import compilation_cache
from flaxformer_mini import decoding
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.checkpoints import CheckpointError
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.data import DataError


# One jitted program per shape for the process: a later call (the next
# evaluation, the next input) with the same shapes reuses the compiled one.
_greedy = jax.jit(decoding.greedy_decode, static_argnames=('config', 'max_len'))
_start_beams = jax.jit(decoding.start_beam_decode, static_argnums=(0, 1, 2, 3))
_continue_beams = jax.jit(decoding.continue_beam_decode,
                          static_argnames=('config', 'alpha',
                                           'stop_at_not_done'))
_take_items = jax.jit(decoding.take_items)


def _next_rows(rows: int) -> int:
  """The rows of the next stage: a quarter, rounded up to a multiple of 8
  (0: this stage is the last).

  A quarter, not a half: each stage's batch shape is one more program to
  compile, and on the Multi30k test set 64 -> 16 rows saves almost all that
  64 -> 32 -> 16 -> 8 does (docs/multi30k.md).
  """
  return 0 if rows <= 16 else -(-rows // 32) * 8


def _beam_search_in_stages(params, src: np.ndarray, config: TransformerConfig,
                           beam_size: int, alpha: float, max_len: int,
                           shrink: bool = True) -> np.ndarray:
  """The best hypothesis of each source: int32[rows, src_len] -> [rows, max_len].

  One beam search in stages: once no more than a quarter of its items are
  still searching, the finished ones are collected and the rest go on alone
  in a batch a quarter the size, so sentences that end early stop paying for
  the slowest one. Each item's result is the one-batch search's (an item's
  search never looks at another's). shrink=False: one stage.
  """
  best = np.zeros((src.shape[0], max_len), np.int32)
  owner = np.arange(src.shape[0])  # the source row of each state row
  state = _start_beams(config, src.shape[0], beam_size, max_len)
  while True:
    rows = _next_rows(len(owner)) if shrink else 0
    state = _continue_beams(params, src[owner], state, config, alpha,
                            stop_at_not_done=rows)
    finished = np.asarray(state.finished_sequences[:, 0, 1:])
    ended = np.asarray(state.done) | (int(state.step) >= max_len) | (rows == 0)
    best[owner[ended]] = finished[ended]
    searching = np.flatnonzero(~ended)
    if not len(searching):
      return best
    # Filler rows repeat a searching item: the same search, the same result.
    keep = np.resize(searching, rows)
    state = _take_items(state, keep)
    owner = owner[keep]


def translate_ids(params, config: TransformerConfig, sources: list[list[int]],
                  beam_size: int = 4, alpha: float = 0.6,
                  batch_size: int = 64,
                  shrink_batches: bool = True) -> list[list[int]]:
  """The best translation of each source (token ids, no eos), in order.

  Sources are sorted by length into batches of `batch_size`, so that the
  sentences of a batch are padded little and tend to end at similar steps.
  With shrink_batches the sentences whose beam search has ended leave their
  batch on the way (`_beam_search_in_stages`): the same translations as one
  stage (shrink_batches=False), 1.4x faster on the Multi30k test set once
  compiled, for a second program per batch shape. Source lengths are rounded
  up to multiples of 16 to bound the number of shapes, hence of programs to
  compile (padding costs the search little: its step is the output layer's
  product). beam_size 1 is greedy search.
  An empty source gives an empty translation; sources longer than
  config.max_len - 1 are cut there.
  """
  limit = config.max_len - 1  # room for eos
  # Parameters of any origin (a host copy, as averaging gives, or a training
  # state's device copy) become arrays on one device: a jitted program is
  # compiled per placement of its arguments, and is reused only for the same.
  params = jax.device_put(params, jax.local_devices()[0])
  order = sorted((i for i, ids in enumerate(sources) if len(ids)),
                 key=lambda i: len(sources[i]))
  outputs = [[] for _ in sources]
  for start in range(0, len(order), batch_size):
    members = order[start:start + batch_size]
    longest = min(max(len(sources[i]) for i in members) + 1, config.max_len)
    length = min(-(-longest // 16) * 16, config.max_len)
    # Rows past the last member repeat the shortest one, and are dropped.
    src = np.full((batch_size, length), config.pad_id, np.int32)
    for row in range(batch_size):
      member = members[row] if row < len(members) else members[0]
      ids = list(sources[member][:limit]) + [config.eos_id]
      src[row, :len(ids)] = ids
    max_len = decoding.default_max_len(config, length)
    if beam_size == 1:
      best = np.asarray(_greedy(params, src, config, max_len))
    else:
      best = _beam_search_in_stages(params, src, config, beam_size, alpha,
                                    max_len, shrink_batches)
    for row, i in enumerate(members):
      outputs[i] = decoding.tokens_before_eos(best[row], config.eos_id,
                                              config.pad_id)
  return outputs


def translate_lines(params, config: TransformerConfig, tokenizer,
                    lines: list[str], beam_size: int = 4, alpha: float = 0.6,
                    batch_size: int = 64, warn=None) -> list[str]:
  """Translations of `lines`, in order; '' for an empty line.

  Sources longer than config.max_len - 1 tokens are cut there and reported
  through `warn(line_number, length)`. See translate_ids for the search.
  """
  encoded = [tokenizer.encode(line.strip()) if line.strip() else []
             for line in lines]
  for number, ids in enumerate(encoded, start=1):
    if len(ids) > config.max_len - 1 and warn is not None:
      warn(number, len(ids))
  return [tokenizer.decode(ids) for ids in translate_ids(
      params, config, encoded, beam_size, alpha, batch_size)]


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


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f'{value}: must be at least 1')
  return value


def _finite_float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):
    raise argparse.ArgumentTypeError(f'{text}: must be a finite number')
  return value


class _OneLineParser(argparse.ArgumentParser):
  def error(self, message):
    self.exit(2, f'{self.prog}: error: {message}\n')


def main(argv: list[str]) -> None:
  parser = _OneLineParser(prog='python -m flaxformer_mini.translate',
                          description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--input', help='a UTF-8 text file (default: stdin).')
  parser.add_argument('--params', choices=['best', 'latest', 'averaged'],
                      default='best', help="the run's choice (default), its "
                      'latest checkpoint, or its averaged parameters.')
  parser.add_argument('--beam_size', type=_positive_int, default=4)
  parser.add_argument('--alpha', type=_finite_float,
                      help="length-penalty exponent (default: the run's "
                      'eval_alpha, the one its scores were decoded with).')
  parser.add_argument('--batch_size', type=_positive_int, default=64,
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
