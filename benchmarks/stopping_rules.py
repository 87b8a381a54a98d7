"""Each stopping rule of the beam search: BLEU against time (CPU).

  python benchmarks/stopping_rules.py --workdir W [--write_docs]

A trained translation run's parameters (the ones the translate command
loads) translate the test and validation splits as the command does
(translation.translate_lines: its batches, stages and windows, the run's
alpha) under each of config.STOPPING_RULES, at beam 4 and at the run's
eval_beam_size: cased sacreBLEU against the references (evaluation.bleu,
as a run scores itself), seconds once compiled (medians of --rounds taken
in turns), and how many translations are the exact rule's. Which rule a
run decodes with by default is chosen from this table: a cheaper rule
becomes the default only where its BLEU is within --within of the exact
rule's on both splits (`meets`). --write_docs writes the table into
docs/performance.md.
"""

import statistics

from flaxformer_mini import evaluation, translation
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.config import STOPPING_RULES

import common
import translate_command

SPLITS = ('test_2016_flickr', 'validation')


def measure(workdir: str, data_dir: str, rounds: int, within: float) -> dict:
  trained = workdir_lib.load_run(workdir)
  config = trained.config
  beams = sorted({4, config.eval_beam_size})
  results, lines = [], {}
  for split in SPLITS:
    sources = translate_command.split_lines(data_dir, config, split)
    lines[split] = len(sources)
    references = translate_command.split_lines(data_dir, config, split,
                                               side=1)
    for beam in beams:
      runs = {rule: (lambda rule: lambda: translation.translate_lines(
          trained.params, config, trained.tokenizer, sources,
          beam_size=beam, stopping=rule))(rule) for rule in STOPPING_RULES}
      outputs = {rule: run() for rule, run in runs.items()}  # compiles
      times = common.interleaved_seconds(runs, rounds)
      for rule in STOPPING_RULES:
        results.append({
            'split': split, 'beam': beam, 'rule': rule,
            **evaluation.bleu(outputs[rule], references),
            'seconds': statistics.median(times[rule]),
            'round_seconds': times[rule],
            'same_as_exact': sum(a == b for a, b in zip(outputs[rule],
                                                        outputs['exact']))})
  return {'params': trained.which, 'alpha': config.eval_alpha,
          'run_stopping': config.eval_stopping,
          'run_beam': config.eval_beam_size, 'lines': lines,
          'within': within, 'results': results,
          'meets': meets(results, within)}


def meets(results: list[dict], within: float) -> dict[str, bool]:
  """Sets each result's BLEU against the exact rule's on its split and
  beam: -> {'RULE, beam B': within `within` of it on every split}."""
  exact = {(r['split'], r['beam']): r['bleu'] for r in results
           if r['rule'] == 'exact'}
  for r in results:
    r['bleu_against_exact'] = r['bleu'] - exact[r['split'], r['beam']]
  return {f'{rule}, beam {beam}': all(
      r['bleu_against_exact'] >= -within for r in results
      if (r['rule'], r['beam']) == (rule, beam))
          for beam in sorted({r['beam'] for r in results})
          for rule in STOPPING_RULES}


def table(result: dict) -> str:
  env = result['environment']
  lines = [
      common.measured_by(
          env, 'benchmarks/stopping_rules.py --workdir=W --write_docs') +
      "the run's "
      f"{result['params']} parameters, α {result['alpha']}, every line of "
      'each split searched as the translate command does (on '
      f"{env['devices']} device(s), one per core); seconds are "
      'medians in turns on this shared machine (rough), BLEU (cased '
      'sacreBLEU) and the counts exact.',
      '',
      '| split, beam | rule | BLEU | against exact | seconds | '
      'same output as exact |', '|---|---|---:|---:|---:|---:|']
  previous = None
  for r in result['results']:
    where = f"{r['split']}, {r['beam']}"
    against = ('—' if r['rule'] == 'exact'
               else f"{r['bleu_against_exact']:+.2f}")
    same = ('—' if r['rule'] == 'exact' else
            f"{r['same_as_exact']:,} / {result['lines'][r['split']]:,}")
    lines.append(f"| {where if where != previous else ''} | {r['rule']} | "
                 f"{r['bleu']:.2f} | {against} | {r['seconds']:.1f} | "
                 f'{same} |')
    previous = where
  kept = [name for name, ok in result['meets'].items()
          if ok and not name.startswith('exact')]
  lines += ['', f"Within {result['within']} BLEU of the exact rule on both "
            'splits: ' + ('; '.join(kept) if kept else 'no cheaper rule') +
            '.']
  return '\n'.join(lines)


MARKERS = ('<!-- stopping-rules:start -->', '<!-- stopping-rules:end -->')


def main():
  parser = translate_command.run_parser(__doc__, rounds=2)
  parser.add_argument('--within', type=float, default=0.1,
                      help='BLEU a cheaper default may lose on each split')
  args = parser.parse_args()
  translate_command.report(
      measure(args.workdir, args.data_dir, args.rounds, args.within), table,
      MARKERS, args.write_docs)


if __name__ == '__main__':
  main()
