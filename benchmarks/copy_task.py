"""Wall time of the copy task, from process start to exact match 1.0.

  python benchmarks/copy_task.py [--runs 1] [--seed 0]

Runs `python train.py --task=copy` (the README's first command, fresh, in a
temporary workdir) as a child process and reports `wall_s`, the child's whole
life from exec to exit (interpreter start-up, imports, compiles, training
until exact match 1.0 on fresh sequences, the final evaluation and the
checkpoint), next to what the run itself recorded. The persistent compilation
cache is off, so every program is compiled (benchmarks/levers.py measures
what a warm cache saves).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(seed: int) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    child = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'),
                            '--task=copy', f'--workdir={workdir}',
                            f'--seed={seed}', '--compilation_cache='],
                           capture_output=True, text=True, cwd=ROOT)
    wall_s = time.perf_counter() - start
    if child.returncode:
      sys.exit(f'train.py --task=copy failed (exit {child.returncode}):\n'
               f'{child.stderr[-4000:]}')
    with open(os.path.join(workdir, 'results.json')) as f:
      results = json.load(f)
  return {'seed': seed, 'wall_s': wall_s,
          'run_wall_seconds': results['wall_seconds'],
          'steps': results['steps'], 'exact_match': results['exact_match']}


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--runs', type=int, default=1)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  runs = [run_once(args.seed + i) for i in range(args.runs)]
  common.emit({'benchmark': 'copy_task', 'runs': runs,
               'median_wall_s': sorted(r['wall_s'] for r in runs)[
                   len(runs) // 2]})


if __name__ == '__main__':
  main()
