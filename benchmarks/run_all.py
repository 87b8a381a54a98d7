"""Runs every benchmark and writes their table into the README.

  python benchmarks/run_all.py            # prints the JSON list, updates README.md
  python benchmarks/run_all.py --no_readme --json results.json
  python benchmarks/run_all.py --from_json results.json   # table only

Two suites: `cpu` (the issue's float32 shapes, the copy task and the levers)
and `accelerator` (bfloat16 on a GPU or TPU: the base step at the issue's
batch and at a batch that fills the chip, float32 at that batch, bfloat16
decoding, the copy task, the levers whose worth depends on the accelerator
and, on a GPU, the bfloat16 step at that batch with cuDNN's fused
attention); the default is the suite of the backend JAX
finds. Results measured on another machine come into the README with
--from_json.

Each benchmark runs in its own process (as a user would run it), so no
compile cache or allocator state leaks from one into the next. The matmul
peak is measured first and passed to the training benchmarks, so one run
has one MFU denominator. Each suite's table sits between its own markers in the
README: <!-- benchmarks:start --> ... <!-- benchmarks:end --> for `cpu`,
<!-- benchmarks-accelerator:start --> ... for `accelerator`.
"""

import argparse
import json
import os
import subprocess
import sys
from typing import Iterator

from train_step import SHAPES

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(os.path.dirname(HERE), 'README.md')
MARKERS = {
    'cpu': ('<!-- benchmarks:start -->', '<!-- benchmarks:end -->'),
    'accelerator': ('<!-- benchmarks-accelerator:start -->',
                    '<!-- benchmarks-accelerator:end -->'),
}
# Sentences per batch that fill a GPU or TPU with the base model: 256 x 64
# source tokens, about the paper's ~25k tokens per step over its 8 GPUs
# (the 16 x 64 leaves an accelerator waiting on kernel launches).
ACCELERATOR_BATCH = 256


def run(script: str, *flags: str) -> dict:
  # stderr passes through, so a benchmark that fails says why.
  output = subprocess.run([sys.executable, os.path.join(HERE, script), *flags],
                          check=True, stdout=subprocess.PIPE, text=True).stdout
  return json.loads(output)


def _peaks(peak: dict) -> str:
  return '; '.join(
      f"{dtype} {best:,.0f} GFLOP/s (" +
      ', '.join(f'{n}: {g:,.0f}' for n, g in peak[dtype].items()) + ')'
      for dtype, best in peak['peak_gflops'].items())


def table(results: list[dict]) -> str:
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
      'target tokens/s | GFLOP/step | MFU | Flax WMT: compile s, step s, '
      'MFU | speed-up |',
      '|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|',
  ]
  for r in rest:
    if r['benchmark'] == 'train_step':
      lines.append(
          f"| train step | {r['config']} | {_variant(r)} | "
          f"{r['compile_s']:.1f} | "
          f"{r['step_s']:.4g} | {r['tokens_per_s']:,.0f} | "
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
        if r.get('dtype', 'float32') != 'float32':
          search += f", {r['dtype']}"
        lines.append(
            f"| decode | {r['config']} | {search} | {d['compile_s']:.1f} | "
            f"{d['first_call_s']:.1f} | {d['step_s'] * 1e3:.1f} ms | "
            f"{d['sentences_per_s']:.0f} | {d['generated_tokens_per_s']:,.0f} | "
            f"{_decode_baseline(d)} |")
  lines += _annotated_table(rest)
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


def _annotated_table(rest: list[dict]) -> list[str]:
  """Rows against the Annotated Transformer, where it ran."""
  rows = []
  for r in rest:
    if r['benchmark'] == 'train_step':
      theirs = r.get('annotated_transformer', {})
      if 'step_s' in theirs:
        rows.append(f"| train step | {r['config']} | {_variant(r)} | "
                    f"{theirs['step_s']:.4g} s, MFU {theirs['mfu']:.0%} | "
                    f"{_speedup(theirs)} |")
    if r['benchmark'] == 'decode':
      for d in r['runs']:
        theirs = d.get('annotated_transformer', {})
        if 'decode_s' in theirs:
          rows.append(f"| decode | {r['config']} | greedy | "
                      f"{theirs['sentences_per_s']:.1f} sentences/s | "
                      f"{theirs['speedup']:.2f}x |")
  if not rows:
    return []
  return ['', '| against the Annotated Transformer (PyTorch) | config | '
          'variant | its figure | speed-up |', '|---|---|---|---:|---:|',
          *rows]


def _variant(r: dict) -> str:
  """'full', or 'full, 256 sentences, bfloat16, cudnn attention' where they differ."""
  parts = [r['pad']]
  if r['batch'] != SHAPES[r['config']][0]:
    parts.append(f"{r['batch']} sentences")
  if r.get('dtype', 'float32') != 'float32':
    parts.append(r['dtype'])
  if r.get('attention_implementation', 'explicit') != 'explicit':
    parts.append(f"{r['attention_implementation']} attention")
  return ', '.join(parts)


def _baseline(r: dict) -> str:
  if 'flax_wmt' not in r:
    return '(not run) | —'
  theirs = r['flax_wmt']
  return (f"{theirs['compile_s']:.1f}, {theirs['step_s']:.4g}, "
          f"{theirs['mfu']:.0%} | {_speedup(r)}")


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
    for pad in ('full', 'pad20'):
      yield run('train_step.py', f'--config={config}', f'--pad={pad}',
                peak_flag)
  for config in ('small', 'base'):
    yield run('decode.py', f'--config={config}', '--beam', '1', '4')
  yield run('copy_task.py')
  yield run('levers.py')


def accelerator_suite(peak: dict) -> Iterator[dict]:
  def base_step(dtype: str, *flags: str) -> dict:
    return run('train_step.py', '--config=base', f'--dtype={dtype}',
               f"--peak_gflops={peak['peak_gflops'][dtype]}", *flags)

  batch = f'--batch={ACCELERATOR_BATCH}'
  yield base_step('bfloat16')
  yield base_step('bfloat16', batch)
  # The baseline's bfloat16 rows are the comparison.
  yield base_step('float32', batch, '--no_baseline')
  yield run('decode.py', '--config=base', '--dtype=bfloat16',
            '--beam', '1', '4')
  yield run('copy_task.py')
  # The levers whose worth depends on the accelerator: the host loop's
  # overlap with the step, and the memory donation saves.
  yield run('levers.py', '--only', 'donated_state', 'metrics_on_device',
            'batches_during_step', '--repeats=6')
  if peak['environment']['backend'] == 'gpu':
    # cuDNN's fused attention, against the bfloat16 step at the same batch;
    # last, so that the rest is measured even where cuDNN refuses the shapes.
    yield base_step('bfloat16', batch, '--attention_implementation=cudnn',
                    '--no_baseline')


SUITES = {'cpu': cpu_suite, 'accelerator': accelerator_suite}


def write_readme(suite: str, results: list[dict]) -> None:
  start, end = MARKERS[suite]
  with open(README) as f:
    text = f.read()
  if start not in text or end not in text:
    sys.exit(f'{README} has no {start} ... {end} markers for the table.')
  head, rest = text.split(start, 1)
  _, tail = rest.split(end, 1)
  with open(README, 'w') as f:
    f.write(f'{head}{start}\n{table(results)}\n{end}{tail}')


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--suite', choices=sorted(MARKERS),
                      help="default: 'cpu' on a CPU backend, else "
                      "'accelerator'")
  parser.add_argument('--no_readme', action='store_true')
  parser.add_argument('--json', help='also write the results to this file')
  parser.add_argument('--from_json',
                      help='write the README table of saved results; run '
                      'nothing')
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
  if not args.no_readme:
    write_readme(suite, results)


if __name__ == '__main__':
  main()
