"""Runs every benchmark and writes their tables into the README and docs/.

  python benchmarks/run_all.py            # prints the JSON list, writes tables
  python benchmarks/run_all.py --no_tables --json results.json
  python benchmarks/run_all.py --from_json results.json   # tables only

Two suites: `cpu` (float32: the training step and decoding of `small` and
`base` against the Flax WMT example, plain and with --cpu_kernels, the copy
task, the levers) and `accelerator` (bfloat16 on a GPU or TPU: the base step
at the paper's shapes and at a batch that fills the chip, decoding, the copy
task, the levers whose worth depends on the accelerator); the default is the
suite of the backend JAX finds. Results measured on another machine come in
with --from_json.

Each benchmark runs in its own process (as a user would run it), so no
compile cache or allocator state leaks from one into the next; in the CPU
suite each starts with common.KEEP_FREED_MEMORY in GLIBC_TUNABLES. The matmul peak is
measured first and passed to the training benchmarks, so one run has one MFU
denominator. Each table sits between its own markers: the CPU speed table in
the README, the CPU levers and the accelerator tables in docs/performance.md.
"""

import argparse
import json
import os
import subprocess
import sys
from typing import Iterator

import common
from train_step import SHAPES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
README = os.path.join(ROOT, 'README.md')
PERFORMANCE = os.path.join(ROOT, 'docs', 'performance.md')
# (file, markers) of each table: the suite's speed table, and its levers.
TABLES = {
    'cpu': (README, '<!-- benchmarks:start -->', '<!-- benchmarks:end -->'),
    'cpu-levers': (PERFORMANCE, '<!-- levers:start -->', '<!-- levers:end -->'),
    'accelerator': (PERFORMANCE, '<!-- benchmarks-accelerator:start -->',
                    '<!-- benchmarks-accelerator:end -->'),
}
# Sentences per batch that fill a GPU or TPU with the base model: 256 x 64
# source tokens, about the paper's ~25k tokens per step over its 8 GPUs.
ACCELERATOR_BATCH = 256


def run(script: str, *flags: str, env: dict | None = None) -> dict:
  # stderr passes through, so a benchmark that fails says why.
  output = subprocess.run([sys.executable, os.path.join(HERE, script), *flags],
                          check=True, stdout=subprocess.PIPE, text=True,
                          env=env).stdout
  return json.loads(output)


def run_on_cpu(script: str, *flags: str) -> dict:
  """run(), with glibc keeping each step's freed host buffers (common.py)."""
  return run(script, *flags, env={**os.environ,
                                  'GLIBC_TUNABLES': common.KEEP_FREED_MEMORY})


def _peaks(peak: dict) -> str:
  return '; '.join(
      f"{dtype} {best:,.0f} GFLOP/s (" +
      ', '.join(f'{n}: {g:,.0f}' for n, g in peak[dtype].items()) + ')'
      for dtype, best in peak['peak_gflops'].items())


def table(results: list[dict]) -> str:
  """The speed table: training steps, decoding, the copy task."""
  peak, *rest = results
  env = peak['environment']
  where = (f"{env['cpu_count']} CPU cores ({env['machine']}" if
           env['backend'] == 'cpu' else
           f"{env['device_kind']} ({env['cpu_count']} CPU cores")
  lines = [
      f"Measured {env['date']} on {where}, {env['backend']}, "
      f"{env['devices']} device(s)), JAX {env['jax']}, by "
      f"`python benchmarks/run_all.py`. Matmul peak: {_peaks(peak)}.",
      '',
      '| benchmark | config | variant | compile s | step s | tokens/s | '
      'MFU | Flax WMT: step s | speed-up (90 % interval) |',
      '|---|---|---|---:|---:|---:|---:|---:|---:|',
  ]
  for r in rest:
    if r['benchmark'] == 'train_step':
      lines.append(
          f"| train step | {r['config']} | {_variant(r)} | "
          f"{r['compile_s']:.1f} | {r['step_s']:.4g} | "
          f"{r['tokens_per_s']:,.0f} | {r['mfu']:.0%} | {_baseline(r)} |")
  lines += ['', '| benchmark | config | search | compile s | step s | '
            'sentences/s | generated tokens/s | Flax WMT: sentences/s | '
            'speed-up (90 % interval) |',
            '|---|---|---|---:|---:|---:|---:|---:|---:|']
  for r in rest:
    if r['benchmark'] == 'decode':
      for d in r['runs']:
        search = 'greedy' if d['beam'] == 1 else f"beam {d['beam']}"
        if r.get('dtype', 'float32') != 'float32':
          search += f", {r['dtype']}"
        lines.append(
            f"| decode | {r['config']} | {search} | {d['compile_s']:.1f} | "
            f"{d['step_s'] * 1e3:.1f} ms | {d['sentences_per_s']:.0f} | "
            f"{d['generated_tokens_per_s']:,.0f} | {_decode_baseline(d)} |")
  for r in rest:
    if r['benchmark'] == 'copy_task':
      lines += ['', _copy_task_line(r)]
  return '\n'.join(lines)


def _copy_task_line(r: dict) -> str:
  """One run: its time, exact match and steps; several seeds: the median
  time, how many copied their final draw perfectly, the range of steps and
  what the further unseen draws found."""
  runs = r['runs']
  line = 'Copy task (`python train.py --task=copy`, process start to exit): '
  if len(runs) == 1:
    return (f"{line}{runs[0]['wall_s']:.1f} s, exact match "
            f"{runs[0]['exact_match']:.0%} after {runs[0]['steps']} steps.")
  perfect = len(runs) - r['final_exact_match_below_1']
  steps = sorted(run['steps'] for run in runs)
  line += (f"{r['median_wall_s']:.1f} s (median of {len(runs)} seeds), exact "
           f"match 100% in {perfect} of {len(runs)} after {steps[0]:,}–"
           f"{steps[-1]:,} steps")
  if 'miscopied' in r:
    line += (f"; their final parameters miscopy {r['miscopied']:,} of "
             f"{r['extra_sequences']:,} further fresh sequences")
  return line + '.'


def lever_table(results: list[dict]) -> str:
  """The levers: each with and without, and whether the project keeps it."""
  lines = []
  for r in results:
    if r['benchmark'] != 'levers':
      continue
    lines += [f"`python benchmarks/levers.py --config={r['config']}`, "
              f"{r['environment']['date']}, {r['environment']['backend']}:",
              '', '| lever | with s | without s | speed-up | kept |',
              '|---|---:|---:|---:|---|']
    for name, lever in r['levers'].items():
      if 'not_run' in lever:
        lines.append(f"| {name} | not run: {lever['not_run']} | | | |")
        continue
      lines.append(f"| {name} | {lever['with_s']:.4f} | "
                   f"{lever['without_s']:.4f} | {lever['speedup']:.2f}x | "
                   f"{_kept(lever['kept'])} |")
    memory = r['levers'].get('donated_state', {}).get('memory_mb')
    if memory:
      lines += ['', f"The donated step's buffers take {memory['with']:,.0f} "
                f"MiB at once, against {memory['without']:,.0f} MiB without "
                "donation (XLA's buffer assignment, `small` step)."]
  return '\n'.join(lines)


def _kept(kept) -> str:
  """yes, no, or what else the lever is (an 'option', off by default)."""
  return {True: 'yes', False: 'no'}.get(kept, kept)


def _variant(r: dict) -> str:
  """'full', or 'full, 256 sentences, bfloat16, cpu_kernels' where they differ."""
  parts = [r['pad']]
  if r['batch'] != SHAPES[r['config']][0]:
    parts.append(f"{r['batch']} sentences")
  if r.get('dtype', 'float32') != 'float32':
    parts.append(r['dtype'])
  if r.get('cpu_kernels'):
    parts.append('--cpu_kernels')
  return ', '.join(parts)


def _baseline(r: dict) -> str:
  if 'flax_wmt' not in r:
    return '(not run) | —'
  return f"{r['flax_wmt']['step_s']:.4g} | {_speedup(r)}"


def _decode_baseline(d: dict) -> str:
  if 'flax_wmt' not in d:
    return '(not run) | —'
  return f"{d['flax_wmt']['sentences_per_s']:.0f} | {_speedup(d)}"


def _speedup(r: dict) -> str:
  """'1.33x (1.29–1.37)': the medians' ratio and its 90 % interval.

  Results saved before the interval was measured give the ratio alone.
  """
  if 'speedup_interval' not in r:
    return f"{r['speedup']:.2f}x"
  low, high = r['speedup_interval']
  return f"{r['speedup']:.2f}x ({low:.2f}–{high:.2f})"


def cpu_suite(peak: dict) -> Iterator[dict]:
  peak_flag = f"--peak_gflops={peak['peak_gflops']['float32']}"
  for config in ('small', 'base'):
    yield run_on_cpu('train_step.py', f'--config={config}', peak_flag)
    yield run_on_cpu('train_step.py', f'--config={config}', '--cpu_kernels',
                     peak_flag)
  for config in ('small', 'base'):
    yield run_on_cpu('decode.py', f'--config={config}', '--beam', '1', '4')
  # train.py as a user runs it, over seeds: how reliably it stops copying.
  yield run('copy_task.py', '--runs=8', '--extra_draws=16')
  yield run_on_cpu('levers.py')


def accelerator_suite(peak: dict) -> Iterator[dict]:
  def base_step(dtype: str, *flags: str) -> dict:
    return run('train_step.py', '--config=base', f'--dtype={dtype}',
               f"--peak_gflops={peak['peak_gflops'][dtype]}", *flags)

  batch = f'--batch={ACCELERATOR_BATCH}'
  yield base_step('bfloat16')
  yield base_step('bfloat16', batch)
  yield base_step('float32', batch, '--no_baseline')
  yield run('decode.py', '--config=base', '--dtype=bfloat16',
            '--beam', '1', '4')
  yield run('copy_task.py')
  # The levers whose worth depends on the accelerator: the host loop's
  # overlap with the step, and the memory donation saves.
  yield run('levers.py', '--only', 'donated_state', 'metrics_on_device',
            'batches_during_step', '--repeats=6')


SUITES = {'cpu': cpu_suite, 'accelerator': accelerator_suite}


def write_table(name: str, content: str) -> None:
  """Replaces the text between table `name`'s markers in its file."""
  path, start, end = TABLES[name]
  with open(path) as f:
    text = f.read()
  if start not in text or end not in text:
    sys.exit(f'{path} has no {start} ... {end} markers for the table.')
  head, rest = text.split(start, 1)
  _, tail = rest.split(end, 1)
  with open(path, 'w') as f:
    f.write(f'{head}{start}\n{content}\n{end}{tail}')


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--suite', choices=sorted(SUITES),
                      help="default: 'cpu' on a CPU backend, else "
                      "'accelerator'")
  parser.add_argument('--no_tables', action='store_true',
                      help='write no table into the README or docs/')
  parser.add_argument('--json', help='also write the results to this file')
  parser.add_argument('--from_json',
                      help='write the tables of saved results; run nothing')
  args = parser.parse_args()
  if args.from_json:
    with open(args.from_json) as f:
      results = json.load(f)
  else:
    results = [run('peak.py')]
  suite = args.suite or (
      'cpu' if results[0]['environment']['backend'] == 'cpu' else
      'accelerator')
  if not args.from_json:
    for result in SUITES[suite](results[0]):
      results.append(result)
      if args.json:  # after each benchmark, so a failure keeps the rest
        with open(args.json, 'w') as f:
          json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
  if not args.no_tables:
    write_table(suite, table(results))
    if suite == 'cpu':
      write_table('cpu-levers', lever_table(results))


if __name__ == '__main__':
  main()
