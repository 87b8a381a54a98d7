"""The benchmarks run, count what they say, and the tables are theirs.

Speed itself is measured by benchmarks/, not here. These check that the
scripts still run (on small shapes, without the baseline, which needs a
download), that the FLOP count behind every MFU figure is the training step's
own matmul work, and that the README's and docs/performance.md's tables are
what run_all.py makes of the raw results committed in docs/. Each runs in a
subprocess from benchmarks/, as a user runs them.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MULTI30K, ROOT
from flaxformer_mini.config import get_config

BENCHMARKS = os.path.join(ROOT, 'benchmarks')
sys.path.insert(0, BENCHMARKS)
import flops  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_the_flop_counter_counts_products_scans_and_branches():
  x, y = np.ones((3, 5), np.float32), np.ones((5, 7), np.float32)
  assert flops.traced_flops(lambda a, b: a @ b, x, y) == 2 * 3 * 5 * 7
  q = np.ones((2, 4, 6, 8), np.float32)  # [batch, heads, len, d_k]
  assert flops.traced_flops(
      lambda a: jnp.einsum('bhqd,bhkd->bhqk', a, a), q) == 2 * 2 * 4 * 6 * 8 * 6
  # A scan's body runs `length` times; a cond runs one branch (the costlier).
  scanned = lambda a, b: jax.lax.scan(lambda c, _: (c, a @ b), 0, None,
                                      length=4)[1]
  assert flops.traced_flops(scanned, x, y) == 4 * 2 * 3 * 5 * 7
  branched = lambda p, a, b: jax.lax.cond(p, lambda: (a @ b).sum(),
                                          lambda: a.sum())
  assert flops.traced_flops(branched, True, x, y) == 2 * 3 * 5 * 7
  with pytest.raises(ValueError, match='while loop'):
    flops.traced_flops(lambda a: jax.lax.while_loop(
        lambda c: c.sum() < 10, lambda c: c @ c, a), np.ones((2, 2)))


def test_the_paper_models_step_counts_three_times_its_forward_products():
  """The traced count of the paper's model equals the analytic one
  (docs/performance.md): 3 x forward, forward = 2 x matmul parameters x
  positions + the attention products. Source and target lengths differ, so
  the cross-attention's keys and values are counted where they are computed.
  """
  config = get_config('small').replace(
      d_model=32, d_ff=64, num_heads=4, src_vocab_size=50, tgt_vocab_size=50,
      num_encoder_layers=2, num_decoder_layers=3, max_len=16)
  batch, src_len, tgt_len = 3, 5, 7
  d, d_ff = config.d_model, config.d_ff
  encoder = (config.num_encoder_layers * (4 * d * d + 2 * d * d_ff) +
             config.num_decoder_layers * 2 * d * d)
  decoder = (config.num_decoder_layers * (6 * d * d + 2 * d * d_ff) +
             d * config.tgt_vocab_size)
  attention = 4 * batch * d * (
      config.num_encoder_layers * src_len**2 +
      config.num_decoder_layers * (tgt_len**2 + tgt_len * src_len))
  forward = 2 * (encoder * batch * src_len + decoder * batch * tgt_len)
  assert flops.step_flops(config, batch, src_len, tgt_len) == 3 * (
      forward + attention)


# run_all.py's tables of saved results (argv: the JSON file, then the names
# of the tables whose markers to print first, one per line, and the table).
_TABLE = """
import json, sys
import run_all
results = json.load(open(sys.argv[1]))
for name in sys.argv[2:]:
  print(*run_all.TABLES[name][1:], sep='\\n')
  print(run_all.lever_table(results) if name.endswith('levers') else
        run_all.table(results))
  print('<!-- end of table -->')
"""


def _python(*args: str) -> str:
  done = subprocess.run([sys.executable, *args], cwd=BENCHMARKS,
                        capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def _benchmark(script: str, *flags: str) -> dict:
  return json.loads(_python(script, *flags))


@pytest.mark.parametrize('name, raw, document', [
    ('cpu', 'benchmarks-cpu.json', 'README.md'),
    ('cpu-levers', 'benchmarks-cpu.json', 'docs/performance.md'),
    ('accelerator', 'benchmarks-h200.json', 'docs/performance.md')])
def test_tables_are_the_committed_results(name, raw, document):
  start, end, table = _python(
      '-c', _TABLE, os.path.join(ROOT, 'docs', raw), name).split(
          '<!-- end of table -->')[0].split('\n', 2)
  with open(os.path.join(ROOT, document)) as f:
    text = f.read()
  assert text.split(start, 1)[1].split(end, 1)[0].strip() == table.strip()


@pytest.mark.slow
def test_benchmarks_run_on_small_shapes_and_make_tables(tmp_path):
  results = [
      _benchmark('peak.py', '--repeats=1'),
      _benchmark('train_step.py', '--config=small', '--batch=2', '--steps=1',
                 '--no_baseline', '--peak_gflops=100', '--cpu_kernels'),
      _benchmark('decode.py', '--config=small', '--batch=2', '--src_len=4',
                 '--gen_len=3', '--beam', '1', '4', '--repeats=1',
                 '--no_baseline'),
      _benchmark('levers.py', '--only', 'closed_form_loss', '--repeats=1'),
      _benchmark('copy_task.py', '--runs=2', '--extra_draws=2', '--',
                 '--copy_length=3', '--train_steps=100'),
  ]
  peak, step, decode, levers, copy = results
  assert peak['peak_gflops']['float32'] > 0
  assert step['step_s'] > 0 and step['compile_s'] > 0 and step['cpu_kernels']
  assert step['tokens_per_s'] == pytest.approx(2 * 2 * 32 / step['step_s'])
  assert step['mfu'] == pytest.approx(
      step['gflop_per_step'] / step['step_s'] / 100)
  assert [run['beam'] for run in decode['runs']] == [1, 4]
  for run in decode['runs']:
    assert run['generated_tokens_per_s'] == pytest.approx(
        3 * run['sentences_per_s'])
  assert list(levers['levers']) == ['closed_form_loss']
  assert [run['seed'] for run in copy['runs']] == [0, 1]
  for run in copy['runs']:
    # Half-trained, so both draws miscopy: the further draws of the same
    # parameters must count about the final draw's error rate.
    assert run['steps'] == 100 and run['extra_sequences'] == 2048
    assert run['miscopied'] / 2048 == pytest.approx(1 - run['exact_match'],
                                                    abs=0.1)
  assert copy['miscopied'] == sum(run['miscopied'] for run in copy['runs'])

  raw = tmp_path / 'results.json'
  raw.write_text(json.dumps(results))
  tables = _python('-c', _TABLE, str(raw), 'cpu', 'cpu-levers')
  assert '| train step | small | full, 2 sentences, --cpu_kernels |' in tables
  assert '| decode | small | beam 4 |' in tables
  assert '| closed_form_loss |' in tables
  assert '(median of 2 seeds), exact match 100% in ' in tables


@pytest.mark.slow
def test_levers_refuses_an_unknown_lever_before_measuring():
  done = subprocess.run(
      [sys.executable, 'levers.py', '--only', 'donated_state', 'cpu_kernel'],
      cwd=BENCHMARKS, capture_output=True, text=True)
  assert done.returncode == 2
  assert 'cpu_kernel: no such lever' in done.stderr
  assert 'cpu_kernels' in done.stderr  # the list of what there is


@pytest.mark.slow
def test_the_translate_benchmark_times_a_trained_workdir(tiny_run, data_slice):
  workdir, _ = tiny_run
  result = _benchmark('translate_command.py', f'--workdir={workdir}',
                      f'--data_dir={data_slice}', '--beam=2', '--batch_size=8',
                      '--repeats=1', '--no_baseline')
  command = result['command']
  assert command['sentences'] == 30 and command['beam'] == 2
  assert command['sentences_per_s'] == pytest.approx(30 / command['seconds'])
  one_stage = command['one_stage']
  assert 0 <= one_stage['row_steps_after_the_end'] < 1
  assert one_stage['same_translations']
  assert command['speed_up_over_one_stage'] == pytest.approx(
      one_stage['seconds'] / command['seconds'])
  assert result['search']['batch'] == 8


@pytest.mark.slow
def test_the_translate_benchmark_sets_ctranslate2_beside_the_command(
    tiny_run, data_slice):
  pytest.importorskip('ctranslate2', reason='the ctranslate2 extra')
  workdir, _ = tiny_run
  result = _benchmark('translate_command.py', f'--workdir={workdir}',
                      f'--data_dir={data_slice}', '--beam=2', '--batch_size=8',
                      '--repeats=1', '--no_baseline', '--ctranslate2',
                      '--rounds=1', '--train_lines=12', '--stopping=exact')
  compared = result['ctranslate2']
  # The rule asked for, not the run's (a new run's default), in the search
  # and the command alike.
  assert (compared['stopping'], compared['runs_stopping']) == (
      'exact', 'current_length')
  searches, processes = compared['searches'], compared['processes']
  assert searches['project']['same_as_project'] == 30
  # The same model: an untrained one runs most lines to the length limit,
  # where the two searches' length penalties hardly differ.
  assert searches['ctranslate2_float32']['same_as_project'] >= 15
  # One translator in the process (a second one slows the first); int8 is
  # scored from its own process's output, the command's equals the search.
  assert 'ctranslate2_int8' not in searches
  assert (processes['test']['ctranslate2_float32']['same_as_project'] ==
          searches['ctranslate2_float32']['same_as_project'])
  assert 0 <= processes['test']['ctranslate2_int8']['same_as_project'] <= 30
  assert processes['test']['command_warm']['same_as_project'] == 30
  assert processes['test']['command_warm']['bleu'] == pytest.approx(
      searches['project']['bleu'])
  # The same run in bfloat16, searched and as a command (--dtype): the
  # command writes what the search gives.
  assert (processes['test']['command_warm_bfloat16']['same_as_project'] ==
          searches['project_bfloat16']['same_as_project'])
  assert processes['test']['command_warm_bfloat16']['bleu'] == (
      pytest.approx(searches['project_bfloat16']['bleu']))
  assert [processes[split]['lines'] for split in ('test', 'train')] == [30, 12]
  # The gap as row-steps times a row-step's time: no search takes fewer
  # than its sentences' own steps; CTranslate2's, read from its beam_size
  # hypotheses, lie between one step per sentence and every beam to the
  # limit (max_len 48), first step on one row; the count comes from the
  # search that was timed; the two factors give the medians' ratio.
  row_steps = searches['row_steps']
  assert row_steps['project'] >= row_steps['project_own'] > 0
  assert 30 <= row_steps['ctranslate2_float32'] <= 30 * (2 * 48 - 1)
  assert row_steps['ctranslate2_same_output'] == 30
  per = row_steps['microseconds_per_row_step']
  assert (per['project'] / per['ctranslate2_float32'] *
          row_steps['project'] / row_steps['ctranslate2_float32']) == (
              pytest.approx(1 / searches['project_over_ctranslate2_float32'][
                  'of_medians']))
  # Its searches run as the command's: one device per core; CTranslate2's
  # as its docs configure a CPU for throughput: one worker per core, each
  # on one thread.
  assert compared['devices'] == len(os.sched_getaffinity(0))
  assert compared['ctranslate2_threads'] == {
      'inter_threads': os.cpu_count(), 'intra_threads': 1}
  # The cold process kept its programs: one source shape for the input, and
  # batches of 8 run in one stage (a later stage starts above 16 rows).
  assert processes['test']['programs'] == 1
  for split in processes.values():
    for kind in ('command_cold', 'command_warm', 'command_cold_bfloat16',
                 'command_warm_bfloat16', 'ctranslate2_float32',
                 'ctranslate2_int8'):
      assert split[kind]['sentences_per_s'] == pytest.approx(
          split['lines'] / split[kind]['median_s'])
  sys.path.insert(0, BENCHMARKS)
  import translate_command  # pylint: disable=g-import-not-at-top
  table = translate_command.ctranslate2_table(result)
  assert '| the command, warm process | 12 train lines |' in table
  assert '| CTranslate2 float32, search alone | 30 test lines |' in table
  assert ('| the search alone, this project in bfloat16 | 30 test lines |'
          in table)
  assert ('| the command in bfloat16, warm process | 12 train lines |'
          in table)
  assert '| CTranslate2 int8, process | 30 test lines |' in table
  assert f"8 per device on {compared['devices']} device(s)" in table
  assert "the stopping rule exact (the run's is current_length)" in table
  assert (f"CTranslate2's: inter_threads {os.cpu_count()}, intra_threads 1)"
          in table)
  assert (f"| this project | {row_steps['project']:,} (") in table
  assert '| project ÷ CTranslate2 |' in table
  assert (f"loaded by the warm one: {processes['test']['programs']} for the "
          'test lines') in table


@pytest.mark.slow
def test_the_cache_windows_benchmark_times_step_parts_and_the_test_set(
    tiny_run, data_slice):
  workdir, _ = tiny_run
  result = _benchmark('cache_windows.py', f'--workdir={workdir}',
                      f'--data_dir={data_slice}', '--repeats=1', '--rounds=1',
                      '--rows=8', '--steps=2')
  parts = result['step_parts']
  assert result['max_len'] == 48  # the tiny run's positional table
  assert set(parts) == {f'{part} @ {length}' for part in (
      'step', 'step, cross-attention per beam', "step, XLA's top-k",
      'without reordering', 'decoder layers only') for length in (24, 48)}
  test_set = result['test_set']
  assert test_set['lines'] == 30
  assert test_set['same_translations'] == 30  # windows change no output
  exported = result['exported']
  assert (exported['lines'], exported['same_translations']) == (30, 30)
  sys.path.insert(0, BENCHMARKS)
  import cache_windows  # pylint: disable=g-import-not-at-top
  table = cache_windows.table(result)
  assert '| step |' in table and '| step, cross-attention per beam |' in table
  assert 'The exported search' in table


@pytest.mark.slow
def test_the_refill_benchmark_counts_row_steps_both_ways(tiny_run, data_slice):
  workdir, _ = tiny_run
  result = _benchmark('refill.py', f'--workdir={workdir}',
                      f'--data_dir={data_slice}', '--rounds=1')
  assert result['lines'] == 30
  assert result['same_translations'] == 30  # slots change no output
  assert result['programs']['slots'] == 3  # start, fill, advance
  # No search computes fewer steps than every sentence's own.
  assert min(result['row_steps'].values()) >= result['least_row_steps'] > 0
  sys.path.insert(0, BENCHMARKS)
  import refill  # pylint: disable=g-import-not-at-top
  assert '| slots refilled as sentences end (`--refill`) |' in refill.table(
      result)


@pytest.mark.slow
def test_the_stopping_rules_benchmark_scores_every_rule_on_both_splits(
    tiny_run, data_slice):
  workdir, _ = tiny_run
  result = _benchmark('stopping_rules.py', f'--workdir={workdir}',
                      f'--data_dir={data_slice}', '--rounds=1',
                      '--within=1000')
  rows = result['results']
  # Both splits, beam 4 and the run's eval_beam_size (2), every rule.
  assert sorted((r['split'], r['beam'], r['rule']) for r in rows) == sorted(
      (split, beam, rule) for split in ('test_2016_flickr', 'validation')
      for beam in (2, 4)
      for rule in ('exact', 'beam_finished', 'current_length'))
  for r in rows:
    exact = next(e for e in rows if e['rule'] == 'exact' and
                 (e['split'], e['beam']) == (r['split'], r['beam']))
    assert r['bleu_against_exact'] == pytest.approx(r['bleu'] - exact['bleu'])
    assert 0 <= r['same_as_exact'] <= 30
  assert all(r['same_as_exact'] == 30 for r in rows if r['rule'] == 'exact')
  # Every rule is within 1,000 BLEU of the exact one.
  assert all(result['meets'].values()) and len(result['meets']) == 6
  sys.path.insert(0, BENCHMARKS)
  import stopping_rules  # pylint: disable=g-import-not-at-top
  table = stopping_rules.table(result)
  assert '| test_2016_flickr, 2 | exact |' in table
  assert ('both splits: beam_finished, beam 2; current_length, beam 2; '
          'beam_finished, beam 4; current_length, beam 4.') in table
  # A criterion no rule but the exact one meets.
  strict = {**result, 'meets': {name: name.startswith('exact')
                                for name in result['meets']}}
  assert 'both splits: no cheaper rule.' in stopping_rules.table(strict)


def test_a_cheaper_rule_meets_the_criterion_only_on_both_splits():
  sys.path.insert(0, BENCHMARKS)
  import stopping_rules  # pylint: disable=g-import-not-at-top
  bleu = {('test', 4, 'exact'): 30.0, ('test', 4, 'beam_finished'): 29.95,
          ('test', 4, 'current_length'): 29.0,
          ('val', 4, 'exact'): 31.0, ('val', 4, 'beam_finished'): 30.85,
          ('val', 4, 'current_length'): 31.2,
          ('test', 5, 'exact'): 30.0, ('test', 5, 'beam_finished'): 30.1,
          ('test', 5, 'current_length'): 29.0,
          ('val', 5, 'exact'): 31.0, ('val', 5, 'beam_finished'): 30.91,
          ('val', 5, 'current_length'): 30.0}
  rows = [{'split': split, 'beam': beam, 'rule': rule, 'bleu': value}
          for (split, beam, rule), value in bleu.items()]
  assert stopping_rules.meets(rows, 0.1) == {
      'exact, beam 4': True, 'beam_finished, beam 4': False,  # val -0.15
      'current_length, beam 4': False,  # test -1.0, though val +0.2
      'exact, beam 5': True, 'beam_finished, beam 5': True,
      'current_length, beam 5': False}
  assert [round(r['bleu_against_exact'], 2) for r in rows[:3]] == [
      0.0, -0.05, -1.0]


def test_the_gap_splits_into_row_steps_times_their_cost():
  sys.path.insert(0, BENCHMARKS)
  import translate_command  # pylint: disable=g-import-not-at-top
  # 1,200 row-steps in 6 s against 800 in 2 s: 1.5x the row-steps, each
  # 2x the cost (5,000 against 2,500 µs), 3x the time in all.
  counted = {'row_steps': {
      'project': 1200, 'project_own': 1000, 'ctranslate2_float32': 800,
      'ctranslate2_same_output': 30,
      'microseconds_per_row_step': {'project': 5000,
                                    'ctranslate2_float32': 2500}}}
  table = '\n'.join(translate_command._row_steps_table(counted, 30))  # pylint: disable=protected-access
  assert '| this project | 1,200 (+20% over its sentences\' own, 1,000) |' in (
      table)
  assert '| project ÷ CTranslate2 | 1.50x | 2.00x |' in table
  assert '1.50 × 2.00 = 3.00×' in table
  # Without a length penalty CTranslate2's steps cannot be read from its
  # output: the table says so instead of a ratio.
  counted['row_steps'].update(ctranslate2_float32=None,
                              microseconds_per_row_step={'project': 5000})
  table = '\n'.join(translate_command._row_steps_table(counted, 30))  # pylint: disable=protected-access
  assert "CTranslate2's row-steps are not counted" in table
  assert 'project ÷ CTranslate2' not in table


@pytest.mark.slow
def test_the_input_benchmark_measures_a_synthetic_corpus(tmp_path):
  if not os.path.isdir(MULTI30K):
    pytest.skip(f'Multi30k is not at {MULTI30K}')
  corpus = tmp_path / 'corpus'
  written = []
  for _ in range(2):  # deterministic: the same files twice
    subprocess.run([sys.executable, 'synthetic_corpus.py', MULTI30K,
                    str(corpus), '--pairs=700'], cwd=BENCHMARKS, check=True,
                   capture_output=True)
    written.append([(corpus / f'train.{lang}').read_text()
                    for lang in ('de', 'en')])
  assert written[0] == written[1]
  assert [len(text.splitlines()) for text in written[0]] == [700, 700]
  assert sorted(os.listdir(corpus)) == sorted(
      ['train.de', 'train.en', 'val.de.gz', 'val.en.gz',
       'test_2016_flickr.de.gz', 'test_2016_flickr.en.gz'])
  result = _benchmark('input_pipeline.py', str(corpus), '--steps=3',
                      '--vocab_size=300', '--config=multi30k')
  record, = result['corpora']
  assert record['pairs'] == 700
  for start in ('first_start', 'second_start'):
    assert 0 < record[start]['seconds_to_first_step'] < record[start]['wall_s']
    assert record[start]['peak_rss_mb'] > 100
  assert [run['threads'] for run in record['input']][0] == 1
  assert all(run['target_tokens_per_s'] > 0 for run in record['input'])
  assert 0 <= record['padding']['bucketed']['padding'] < 1
  assert record['padding']['packed']['shapes'] == 1
  assert record['host_loop']['ceiling_steps_per_s'] > 0
  assert 0 <= record['host_loop']['host_wait_share'] <= 1
