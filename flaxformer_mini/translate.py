"""The translate command: a trained workdir turns sentences into translations.

  python -m flaxformer_mini.translate --workdir runs/translate < input.txt
  python -m flaxformer_mini.translate --workdir runs/translate --input in.txt

Reads the config and the SentencePiece model from the workdir, and the
parameters the run chose for translation (the averaged or the last
checkpoint, whichever scored better on validation; `--params` picks one).
Lines are split on '\\n' alone, sorted by length into batches and
beam-searched; line i of the output always answers line i of the input, and
an empty input line gives an empty output line.

  ... --sample --seed=1 --num_samples=4 --top_p=0.9 < input.txt

draws translations from the model instead (as back-translation wants): N
samples per line are written as N consecutive lines, the same for a seed
whatever --batch_size.

It ends as a Unix filter does: quietly when its reader has gone (`| head`,
exit 141), in one line when the output cannot be written (a full disk) or
on Ctrl-C (exit 130); a --beam_size that cannot fit in the device's memory
is refused before anything compiles.
"""

import os
import signal
import sys

from flaxformer_mini import cli, compilation_cache
from flaxformer_mini.config import DTYPES, STOPPING_RULES
from flaxformer_mini.data import DataError
from flaxformer_mini.data.lines import split_lines


def _input_lines(parser, path: str | None) -> list[str]:
  """The input's lines: stdin, or any readable file, pipe or device."""
  if path is not None and os.path.isdir(path):
    parser.error(f'--input={path}: a folder, not a file.')
  try:
    if path is None:
      return split_lines(sys.stdin.buffer.read(), 'stdin')
    with open(path, 'rb') as f:
      return split_lines(f.read(), f'--input={path}')
  except FileNotFoundError:
    parser.error(f'--input={path}: no such file.')
  except OSError as e:
    parser.error(f'--input={path}: cannot be read ({e.strerror}).')
  except DataError as e:
    parser.error(str(e))


def _check_memory(parser, config, beam_size: int, batch_size: int) -> None:
  """Refuses a search that cannot fit in the device's memory, before it
  compiles (an XLA out-of-memory error would come after a long wait)."""
  import jax  # pylint: disable=g-import-not-at-top
  from flaxformer_mini import translation  # pylint: disable=g-import-not-at-top
  need = translation.search_bytes(config, batch_size, beam_size)
  have = translation.device_memory_bytes()
  if have is not None and need > have:
    devices = jax.local_devices()
    platform = devices[0].platform.upper()
    where = (f'each of the {len(devices)} {platform} devices'
             if len(devices) > 1 else f'this {platform}')
    parser.error(
        f'--beam_size={beam_size}: a search of --batch_size={batch_size} '
        f'sentences with {beam_size} beams needs about {need / 2**30:.1f} '
        f'GB, more than the {have / 2**30:.1f} GB of {where}; lower '
        '--beam_size or --batch_size.')


def _one_device_per_core() -> None:
  """On a CPU host, one JAX device per core, each searching its own share
  of every batch: 1.3x faster on 2 cores than one device whose operations
  spread over both (docs/performance.md, "Every device searches its
  share"). Left as it is where XLA_FLAGS or JAX_NUM_CPU_DEVICES say how
  many, or where JAX has already started (the command called from Python)."""
  import jax  # pylint: disable=g-import-not-at-top
  if ('xla_force_host_platform_device_count' in os.environ.get('XLA_FLAGS', '')
      or jax.config.jax_num_cpu_devices >= 0):
    return
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
           else os.cpu_count() or 1)
  try:
    jax.config.update('jax_num_cpu_devices', cores)
  except RuntimeError:  # its devices are made already
    pass


def _sampling(parser, args) -> dict | None:
  """The fields of the translation.Sampling the flags ask for, or None; a
  sampling flag without --sample is refused (it would be ignored)."""
  given = {name: getattr(args, name) for name in
           ('seed', 'num_samples', 'temperature', 'top_k', 'top_p')
           if getattr(args, name) is not None}
  if not args.sample:
    if given:
      parser.error(f'--{next(iter(given))} draws translations: add --sample.')
    return None
  return given


def _write(text: str) -> None:
  """Writes to stdout and ends as a Unix filter does when it cannot."""
  try:
    sys.stdout.write(text)
    sys.stdout.flush()
  except OSError as e:
    # Python flushes stdout once more as it exits: let that go nowhere.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if isinstance(e, BrokenPipeError):  # the reader has gone (`| head`)
      sys.exit(128 + signal.SIGPIPE)
    sys.exit(f'translate: error: the translations could not be written '
             f'({e.strerror}).')


def main(argv: list[str]) -> None:
  parser = cli.OneLineParser(prog='python -m flaxformer_mini.translate',
                             description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--input', help='a UTF-8 text file, pipe or device '
                      '(default: stdin).')
  parser.add_argument('--params', choices=['best', 'latest', 'averaged'],
                      default='best', help="the run's choice (default), its "
                      'latest checkpoint, or its averaged parameters.')
  parser.add_argument('--beam_size', type=cli.positive_int, default=4)
  parser.add_argument('--alpha', type=cli.finite_float,
                      help="length-penalty exponent (default: the run's "
                      'eval_alpha, the one its scores were decoded with).')
  parser.add_argument('--stopping', choices=STOPPING_RULES,
                      help="when a sentence's beam search ends (default: the "
                      "run's eval_stopping; 'exact': when no longer "
                      "hypothesis could win; 'current_length', a new run's: "
                      'once beam_size have finished and none live beats them '
                      'at its current length).')
  parser.add_argument('--dtype', choices=DTYPES,
                      help="the search's activations, products and key/value "
                      "cache (default: the run's dtype). bfloat16 decodes a "
                      'float32 run 1.5x faster on a CPU with bfloat16 units '
                      '(AMX or AVX-512 BF16), as on a TPU or GPU, for a few '
                      'translations in a hundred different '
                      '(docs/performance.md).')
  parser.add_argument('--batch_size', type=cli.positive_int, default=64,
                      help='sentences per search on each device (a CPU '
                      'host has one device per core); an input too small '
                      'to fill them is searched in fewer.')
  parser.add_argument('--refill', action='store_true',
                      help='search in --batch_size slots, each taking the '
                      'next sentence as soon as its own is done (continuous '
                      'batching): 3 programs for any input, but on a CPU '
                      'slower than the default batches by length '
                      '(docs/performance.md).')
  sampling = parser.add_argument_group(
      'sampling', 'draw translations instead of searching for the best')
  sampling.add_argument('--sample', action='store_true')
  sampling.add_argument('--seed', type=int, help='default 0.')
  sampling.add_argument('--num_samples', type=cli.positive_int,
                        help='translations per line, on consecutive lines '
                        '(default 1).')
  sampling.add_argument('--temperature', type=cli.non_negative_float,
                        help='default 1; 0 is greedy.')
  sampling.add_argument('--top_k', type=cli.positive_int,
                        help='draw among the k most likely tokens only.')
  sampling.add_argument('--top_p', type=cli.probability,
                        help='draw among the fewest most likely tokens whose '
                        'probability reaches p only (nucleus sampling).')
  compilation_cache.add_flag(parser)
  args = parser.parse_args(argv)
  sampling = _sampling(parser, args)
  if args.refill and sampling is not None:
    parser.error('--refill is for the beam search; --sample draws in batches.')
  if missing := cli.missing_translation_extras():
    parser.error(missing)
  lines = _input_lines(parser, args.input)
  # JAX loads here, once the flags and the input are known to be good.
  # pylint: disable=g-import-not-at-top
  import jax
  from flaxformer_mini import translation
  # pylint: enable=g-import-not-at-top
  _one_device_per_core()
  compilation_cache.use(args.compilation_cache)
  # The search's programs, whole: a later process loads them instead of
  # tracing, lowering and compiling them again.
  executables = compilation_cache.Executables(
      args.compilation_cache,
      note=lambda line: print(f'translate: note: {line}', file=sys.stderr)
  ) if args.compilation_cache else None
  run = cli.load_translation_run(
      parser, args.workdir, args.params,
      params_shape=executables.params_shape if executables else None)
  config = run.config.replace(dtype=args.dtype or run.config.dtype)
  if sampling is not None:
    sampling = translation.Sampling(**sampling)
  _check_memory(parser, config,
                sampling.num_samples if sampling else args.beam_size,
                args.batch_size)
  warn = lambda number, length: print(
      f'translate: line {number} has {length} tokens; cut to '
      f'{config.max_len - 1} (the model\'s max_len)', file=sys.stderr)
  try:
    translations = translation.translate_lines(
        run.params, config, run.tokenizer, lines, beam_size=args.beam_size,
        alpha=args.alpha, batch_size=args.batch_size, warn=warn,
        stopping=args.stopping, refill=args.refill, sampling=sampling,
        executables=executables)
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    parser.error(f'the search ran out of device memory; lower --beam_size '
                 f'(now {args.beam_size}) or --batch_size (now '
                 f'{args.batch_size}).')
  _write(''.join(line + '\n' for line in translations))


def _interrupted(signum, frame) -> None:
  """Ctrl-C: one line and the shell's code for SIGINT, at once.

  The command writes nothing before its output, so there is nothing to
  finish; exiting from the handler also ends it where a KeyboardInterrupt
  would be swallowed (in a garbage-collection callback while JAX loads).
  """
  del frame
  # os.write, not print: the signal may come in the middle of a print.
  os.write(sys.stderr.fileno(), b'\ntranslate: interrupted\n')
  os._exit(128 + signum)  # pylint: disable=protected-access


if __name__ == '__main__':
  signal.signal(signal.SIGINT, _interrupted)
  main(sys.argv[1:])
