"""The benchmarks run, count what the README says, and its tables are theirs.

Speed itself is measured by benchmarks/, not here. These check that the
scripts still run (on small shapes, without the baselines, which need a
download), that the FLOP count behind every MFU figure is the training step's
own matmul work, and that the README's tables are what run_all.py makes of the
raw results committed in docs/. Each runs in a subprocess from benchmarks/, as
a user runs them: benchmarks/common.py changes the process's malloc on import
(host_memory.keep_freed_memory), which this process must not inherit.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

BENCHMARKS = os.path.join(ROOT, 'benchmarks')

# The training step's products, read from its jaxpr, against
# train_step.model_flops_per_step; source and target lengths differ, so the
# cross-attention's keys and values are counted where they are computed.
_FLOPS_OF_THE_STEP = """
import functools, json
import jax, numpy as np
import matmul_floor, train_step as bench
from flaxformer_mini.config import get_config
from flaxformer_mini.masks import make_batch
from flaxformer_mini.training import create_train_state, train_step
config = get_config('small').replace(
    d_model=32, d_ff=64, num_heads=4, src_vocab_size=50, tgt_vocab_size=50,
    num_encoder_layers=2, num_decoder_layers=3, max_len=16)
batch, src_len, tgt_len = 3, 5, 7
ids = np.random.default_rng(0).integers(3, 50, (batch, tgt_len + 1))
step = functools.partial(train_step, config=config)
jaxpr = jax.make_jaxpr(step)(
    create_train_state(config, jax.random.key(0)),
    make_batch(ids[:, :src_len].astype(np.int32), ids.astype(np.int32),
               config),
    jax.random.key(1))
traced = sum(count * matmul_floor.product_flops(*product) for product, count
             in matmul_floor.dot_generals(jaxpr.jaxpr).items())
print(json.dumps({'traced': traced, 'formula': bench.model_flops_per_step(
    config, batch, src_len, tgt_len)}))
"""

# run_all.py's table of saved results (argv: the JSON file, and a suite whose
# README markers to print first, one per line).
_TABLE = """
import json, sys
import run_all
for suite in sys.argv[2:]:
  print(*run_all.MARKERS[suite], sep='\\n')
print(run_all.table(json.load(open(sys.argv[1]))))
"""


def _python(*args: str) -> str:
  done = subprocess.run([sys.executable, *args], cwd=BENCHMARKS,
                        capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def _benchmark(script: str, *flags: str) -> dict:
  return json.loads(_python(script, *flags))


def test_flop_count_is_the_training_steps_matmuls():
  counts = json.loads(_python('-c', _FLOPS_OF_THE_STEP))
  assert counts['traced'] == counts['formula']


@pytest.mark.parametrize('suite, raw', [
    ('cpu', 'benchmarks-cpu.json'), ('accelerator', 'benchmarks-h200.json')])
def test_readme_tables_are_the_committed_results(suite, raw):
  start, end, table = _python(
      '-c', _TABLE, os.path.join(ROOT, 'docs', raw), suite).split('\n', 2)
  with open(os.path.join(ROOT, 'README.md')) as f:
    readme = f.read()
  assert readme.split(start, 1)[1].split(end, 1)[0].strip() == table.strip()


def test_benchmarks_run_on_small_shapes_and_make_a_table(tmp_path):
  results = [
      _benchmark('peak.py', '--repeats=1'),
      _benchmark('train_step.py', '--config=small', '--batch=2', '--steps=1',
                 '--no_baseline', '--peak_gflops=100'),
      _benchmark('decode.py', '--config=small', '--batch=2', '--src_len=4',
                 '--gen_len=3', '--beam', '1', '4', '--repeats=1',
                 '--no_baseline'),
      _benchmark('levers.py', '--only', 'two_reduction_argmax',
                 '--repeats=1'),
  ]
  peak, step, decode, levers = results
  assert peak['peak_gflops']['float32'] > 0
  assert step['step_s'] > 0 and step['compile_s'] > 0
  assert step['tokens_per_s'] == pytest.approx(2 * 2 * 32 / step['step_s'])
  assert step['mfu'] == pytest.approx(
      step['gflop_per_step'] / step['step_s'] / 100)
  assert [run['beam'] for run in decode['runs']] == [1, 4]
  for run in decode['runs']:
    assert run['generated_tokens_per_s'] == pytest.approx(
        3 * run['sentences_per_s'])
  assert list(levers['levers']) == ['two_reduction_argmax']

  raw = tmp_path / 'results.json'
  raw.write_text(json.dumps(results))
  table = _python('-c', _TABLE, str(raw))
  assert '| train step | small | full, 2 sentences |' in table
  assert '| decode | small | beam 4 |' in table
  assert '| two_reduction_argmax |' in table


def test_levers_refuses_an_unknown_lever_before_measuring():
  done = subprocess.run(
      [sys.executable, 'levers.py', '--only', 'donated_state', 'fused_qvk'],
      cwd=BENCHMARKS, capture_output=True, text=True)
  assert done.returncode == 2
  assert 'fused_qvk: no such lever' in done.stderr
  assert 'fused_qkv' in done.stderr  # the list of what there is
