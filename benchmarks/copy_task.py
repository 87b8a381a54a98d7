"""Wall time of the copy task, from process start to exact match 1.0.

  python benchmarks/copy_task.py [--runs 1] [--seed 0] [--extra_draws 0]
                                 [-- TRAIN.PY FLAGS]

Runs `python train.py --task=copy` (the README's first command, fresh, in a
temporary workdir) as a child process and reports `wall_s`, the child's whole
life from exec to exit (interpreter start-up, imports, compiles, training
until exact match 1.0 on fresh sequences, the final evaluation and the
checkpoint), next to what the run itself recorded. The persistent compilation
cache is off, so every program is compiled (benchmarks/levers.py measures
what a warm cache saves).

`--extra_draws K` then measures how reliably the stopping rule stops: the
run's final parameters copy K more draws of 1,024 fresh sequences, draws
train_steps + 1 on, which neither its evaluations (draw = step) nor its final
score (draw 0) use, and `miscopied` counts the sequences they get wrong. Flags
after `--` go to train.py (`-- --copy_length=5`).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.tasks import train_copy

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def miscopied(workdir: str, draws: int) -> int:
  """Sequences the run's final parameters miscopy in `draws` unseen draws."""
  run = workdir_lib.load_run(workdir)
  config, params = run.config, run.params
  decode_fn = train_copy.greedy_copier(config)
  parallel = DataParallel(config)
  wrong = 0
  for draw in range(config.train_steps + 1, config.train_steps + 1 + draws):
    match, _, _ = train_copy.exact_match(params, config, decode_fn, draw, parallel)
    wrong += round((1 - match) * train_copy.EVAL_SEQUENCES)
  return wrong


def run_once(seed: int, extra_draws: int, train_flags: list[str]) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    child = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'),
                            '--task=copy', f'--workdir={workdir}',
                            f'--seed={seed}', '--compilation_cache=',
                            *train_flags],
                           capture_output=True, text=True, cwd=ROOT)
    wall_s = time.perf_counter() - start
    if child.returncode:
      sys.exit(f'train.py --task=copy failed (exit {child.returncode}):\n'
               f'{child.stderr[-4000:]}')
    results = workdir_lib.read_json(os.path.join(workdir,
                                                 workdir_lib.RESULTS))
    run = {'seed': seed, 'wall_s': wall_s,
           'run_wall_seconds': results['wall_seconds'],
           'steps': results['steps'], 'exact_match': results['exact_match']}
    if extra_draws:
      run['miscopied'] = miscopied(workdir, extra_draws)
      run['extra_sequences'] = extra_draws * train_copy.EVAL_SEQUENCES
  return run


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--runs', type=int, default=1)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--extra_draws', type=int, default=0)
  parser.add_argument('train_flags', nargs='*',
                      help='flags for train.py, after --')
  args = parser.parse_args()
  runs = [run_once(args.seed + i, args.extra_draws, args.train_flags)
          for i in range(args.runs)]
  summary = {'benchmark': 'copy_task', 'runs': runs,
             'median_wall_s': sorted(r['wall_s'] for r in runs)[
                 len(runs) // 2],
             'final_exact_match_below_1': sum(r['exact_match'] < 1.0
                                              for r in runs)}
  if args.extra_draws:
    summary['miscopied'] = sum(r['miscopied'] for r in runs)
    summary['extra_sequences'] = sum(r['extra_sequences'] for r in runs)
  common.emit(summary)


if __name__ == '__main__':
  main()
