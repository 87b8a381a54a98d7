"""Runs every benchmark and writes their table into the README.

  python benchmarks/run_all.py            # prints the JSON list, updates README.md
  python benchmarks/run_all.py --no_readme

Each benchmark runs in its own process (as a user would run it), so no
compile cache or allocator state leaks from one into the next. The matmul
peak is measured first and passed to the training benchmarks, so one run
has one MFU denominator. The README's table sits between the markers
<!-- benchmarks:start --> and <!-- benchmarks:end -->.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(os.path.dirname(HERE), 'README.md')
START, END = '<!-- benchmarks:start -->', '<!-- benchmarks:end -->'


def run(script: str, *flags: str) -> dict:
  output = subprocess.run([sys.executable, os.path.join(HERE, script), *flags],
                          check=True, capture_output=True, text=True).stdout
  return json.loads(output)


def table(results: list[dict]) -> str:
  peak, *rest = results
  env = peak['environment']
  lines = [
      f"Measured {env['date']} on {env['cpu_count']} CPU cores "
      f"({env['machine']}, {env['backend']}, {env['devices']} device(s)), "
      f"JAX {env['jax']}, float32, by `python benchmarks/run_all.py`. "
      f"Matmul peak: {peak['peak_gflops']['float32']:.0f} GFLOP/s "
      f"(2048: {peak['float32']['2048']:.0f}, 4096: "
      f"{peak['float32']['4096']:.0f}).",
      '',
      '| benchmark | config | variant | compile s | step s | tokens/s | '
      'target tokens/s | GFLOP/step | MFU | Flax WMT: compile s, step s, '
      'MFU | speed-up |',
      '|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|',
  ]
  for r in rest:
    if r['benchmark'] == 'train_step':
      lines.append(
          f"| train step | {r['config']} | {r['pad']} | {r['compile_s']:.1f} | "
          f"{r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
          f"{r['target_tokens_per_s']:,.0f} | {r['gflop_per_step']:.1f} | "
          f"{r['mfu']:.0%} | {_baseline(r)} |")
  lines += ['', '| benchmark | config | search | compile s | first call s | '
            'step s | sentences/s | generated tokens/s | Flax WMT: '
            'sentences/s | speed-up |',
            '|---|---|---|---:|---:|---:|---:|---:|---:|---:|']
  for r in rest:
    if r['benchmark'] == 'decode':
      for d in r['runs']:
        search = 'greedy' if d['beam'] == 1 else f"beam {d['beam']}"
        lines.append(
            f"| decode | {r['config']} | {search} | {d['compile_s']:.1f} | "
            f"{d['first_call_s']:.1f} | {d['step_s'] * 1e3:.1f} ms | "
            f"{d['sentences_per_s']:.0f} | {d['generated_tokens_per_s']:,.0f} | "
            f"{d['flax_wmt']['sentences_per_s']:.0f} | {d['speedup']:.2f}x |")
  for r in rest:
    if r['benchmark'] == 'copy_task':
      run_ = r['runs'][0]
      lines += ['', f"Copy task (`python train.py --task=copy`, process start "
                f"to exit): {run_['wall_s']:.1f} s, exact match "
                f"{run_['exact_match']:.0%} after {run_['steps']} steps."]
    if r['benchmark'] == 'levers':
      lines += ['', '| lever | with s | without s | speed-up | kept |',
                '|---|---:|---:|---:|---|']
      for name, lever in r['levers'].items():
        lines.append(f"| {name} | {lever['with_s']:.4f} | "
                     f"{lever['without_s']:.4f} | {lever['speedup']:.2f}x | "
                     f"{'yes' if lever['kept'] else 'no'} |")
  return '\n'.join(lines)


def _baseline(r: dict) -> str:
  theirs = r['flax_wmt']
  return (f"{theirs['compile_s']:.1f}, {theirs['step_s']:.3f}, "
          f"{theirs['mfu']:.0%} | {r['speedup']:.2f}x")


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--no_readme', action='store_true')
  args = parser.parse_args()
  peak = run('peak.py')
  peak_flag = f"--peak_gflops={peak['peak_gflops']['float32']}"
  results = [peak]
  for config in ('small', 'base'):
    for pad in ('full', 'pad20'):
      results.append(run('train_step.py', f'--config={config}', f'--pad={pad}',
                         peak_flag))
  for config in ('small', 'base'):
    results.append(run('decode.py', f'--config={config}', '--beam', '1', '4'))
  results.append(run('copy_task.py'))
  results.append(run('levers.py'))
  print(json.dumps(results, indent=2))
  if not args.no_readme:
    with open(README) as f:
      text = f.read()
    if START not in text or END not in text:
      sys.exit(f'{README} has no {START} ... {END} markers for the table.')
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(README, 'w') as f:
      f.write(f'{head}{START}\n{table(results)}\n{END}{tail}')


if __name__ == '__main__':
  main()
