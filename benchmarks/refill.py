"""What rows that refill buy the translate command's beam search (CPU).

  python benchmarks/refill.py --workdir W [--write_docs]

The test set (--split) of a trained translation run searched as the
translate command does (translation.translate_ids, beam 4, the run's alpha
and stopping rule) in its two ways: batches by length in stages, their
cache grown in windows (the default), and slots refilled as sentences end
(refill=True). For each: the beam row-steps computed (counted on a
separate pass, against the least any search computes: every sentence's own
steps to its end), the programs compiled, and sentences/s once compiled,
timed in turns; and how many translations are the same. --write_docs
writes the table into docs/performance.md.
"""

import statistics

from flaxformer_mini import translation
from flaxformer_mini import workdir as workdir_lib

import common
import translate_command

MODES = {'stages': {}, 'slots': {'refill': True}}


def measure(workdir: str, data_dir: str, split: str, rounds: int,
            beam: int) -> dict:
  trained = workdir_lib.load_run(workdir)
  config, vocab = trained.config, trained.tokenizer
  lines = translate_command.split_lines(data_dir, config, split)
  sources = [vocab.encode(line) for line in lines]
  runs = {mode: (lambda kwargs: lambda: translation.translate_ids(
      trained.params, config, sources, beam_size=beam, **kwargs))(kwargs)
          for mode, kwargs in MODES.items()}
  outputs = {mode: run() for mode, run in runs.items()}  # compiles
  programs = {mode: sum(getattr(translation, name)._cache_size()  # pylint: disable=protected-access
                        for name in names)
              for mode, names in translate_command.PROGRAMS.items()}
  times = common.interleaved_seconds(runs, rounds)
  medians = {mode: statistics.median(t) for mode, t in times.items()}
  counts = translate_command.counted_row_steps(runs.values(), beam)
  least = beam * sum(counts['own_steps'])
  return {'lines': len(lines), 'split': split, 'beam': beam,
          'seconds': times,
          'sentences_per_s': {m: len(lines) / s for m, s in medians.items()},
          'slots_against_stages': medians['stages'] / medians['slots'],
          'row_steps': counts['row_steps'],
          'least_row_steps': least,
          'over_least': {m: n / least - 1
                         for m, n in counts['row_steps'].items()},
          'programs': programs,
          'same_translations': sum(a == b for a, b in zip(
              outputs['stages'], outputs['slots']))}


def table(result: dict) -> str:
  env = result['environment']
  lines = [
      common.measured_by(env,
                         'benchmarks/refill.py --workdir=W --write_docs') +
      'the '
      f"{result['lines']:,} lines of {result['split']}, beam "
      f"{result['beam']}, the run's α and stopping rule, the stages on "
      f"{env['devices']} device(s) (one per core), the slots on one, medians "
      'in turns.',
      '',
      '| search | sentences/s | beam row-steps | over the least | '
      'programs |', '|---|---:|---:|---:|---:|']
  names = {'stages': 'batches by length, in stages, cache in windows '
                     '(default)',
           'slots': 'slots refilled as sentences end (`--refill`)'}
  for mode, name in names.items():
    lines.append(
        f"| {name} | {result['sentences_per_s'][mode]:.0f} | "
        f"{result['row_steps'][mode]:,} | "
        f"{result['over_least'][mode]:+.0%} | {result['programs'][mode]} |")
  lines += ['', f"The least any search computes, every sentence's own steps "
            f"to its end: {result['least_row_steps']:,} row-steps. "
            f"{result['same_translations']:,} of {result['lines']:,} "
            'translations the same.']
  return '\n'.join(lines)


MARKERS = ('<!-- refill:start -->', '<!-- refill:end -->')


def main():
  parser = translate_command.run_parser(__doc__, rounds=3)
  parser.add_argument('--split', default='test_2016_flickr')
  parser.add_argument('--beam', type=int, default=4)
  args = parser.parse_args()
  translate_command.report(
      measure(args.workdir, args.data_dir, args.split, args.rounds,
              args.beam), table, MARKERS, args.write_docs)


if __name__ == '__main__':
  main()
