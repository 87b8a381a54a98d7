"""The translate command's speed where users feel it: a test set, beam 4.

  python benchmarks/translate_command.py --workdir runs/multi30k-en-de \
      --data_dir ../shared/data/multi30k

With a trained workdir: its model translates the test split's source lines
(test_2016_flickr: 1,000 lines) as `python -m flaxformer_mini.translate`
does (translation.translate_ids: sorted by length, batches of --batch_size,
beam --beam; ended sentences leave their batch on the way), twice: the
first pass compiles, the second is timed. Reports sentences/s and generated
tokens/s (eos included). The same again in one stage (shrink_batches=False:
every batch searches to its slowest sentence), against the first in this
process, with the share of its row-steps that go to sentences already ended.

Then the same search against the Flax WMT example's beam_search on the same
model shape (random weights, eos impossible so both do the same work, the
batch and generated length of an average test batch), timed in turns
(decode.py's measure). Without --workdir, only this comparison runs, on the
multi30k preset's shape.

  ... --ctranslate2 [--rounds=2]

With a workdir, also against CTranslate2 (the ctranslate2 extra) on the same
weights, converted by flaxformer_mini.to_ctranslate2, beam --beam, its length
penalty set to the run's alpha (a different formula: to_ctranslate2 says
how), batches of --batch_size, every core: the searches alone in this
process, in turns (the project's compiled search, in float32 and in bfloat16,
and CTranslate2's in float32: a second CTranslate2 translator in one process
slows the first), on the test
lines, and where the gap between them is: the beam row-steps each search
takes (the project's counted in its programs, against its sentences' own
steps to their ends; CTranslate2's read from its hypotheses) and the time of
one; then whole processes, in turns, on the test lines and the first
--train_lines lines of the training split: the translate command with an
empty compilation cache (cold) and again on it (warm), in float32 and with
--dtype=bfloat16, and a CTranslate2
process (import, load, tokenize, translate, write) in float32 and int8, each
process's output on the test lines scored (BLEU, lines the same as the
project's search). With --write_docs the table goes into docs/performance.md.
"""

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from flaxformer_mini import decoding, translate, translation
from flaxformer_mini.translation import translate_ids
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.config import STOPPING_RULES, get_config
from flaxformer_mini.data import parallel_text
from flaxformer_mini.data.lines import read_lines

import common
import decode as decode_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI30K = os.path.join(os.path.dirname(ROOT), 'shared', 'data', 'multi30k')


def split_lines(data_dir: str, config, split: str,
                 side: int = 0) -> list[str]:
  """A split's source (side 0) or target (1) lines, stripped."""
  files = parallel_text.local_split_files(data_dir,
                                          (config.src_lang, config.tgt_lang))
  return [line.strip() for line in read_lines(files[split][side])]


def _timed_passes(run) -> tuple[float, float, list]:
  """run() twice: -> (first pass s, second pass s, the second's outputs)."""
  start = time.perf_counter()
  run()
  first_s = time.perf_counter() - start
  start = time.perf_counter()
  outputs = run()
  return first_s, time.perf_counter() - start, outputs


def translate_command(workdir: str, data_dir: str, split: str, beam: int,
                      batch_size: int, stopping: str | None
                      ) -> tuple[dict, object]:
  """The trained model on the test split -> (figures, its config)."""
  trained = workdir_lib.load_run(workdir)
  config, params = trained.config, trained.params
  sources = [trained.tokenizer.encode(line) for line in
             split_lines(data_dir, config, split)]
  run = functools.partial(translate_ids, params, config, sources,
                          beam_size=beam, batch_size=batch_size,
                          stopping=stopping)
  first_s, seconds, outputs = _timed_passes(run)
  one_first_s, one_seconds, one_outputs = _timed_passes(
      functools.partial(run, shrink_batches=False))
  generated = sum(len(o) + 1 for o in outputs)  # + eos
  # Row-steps to each batch's longest output against those the sentences
  # needed (the batches are sorted by source length, as translate_ids makes
  # them): what one-stage batches spend past each sentence's end.
  order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
  needed = spent = 0
  for start_row in range(0, len(order), batch_size):
    lengths = [len(outputs[i]) + 1 for i in order[start_row:start_row + batch_size]]
    needed += sum(lengths)
    spent += max(lengths) * len(lengths)
  return {'sentences': len(sources), 'beam': beam, 'batch_size': batch_size,
          'params': trained.which, 'first_pass_s': first_s, 'seconds': seconds,
          'sentences_per_s': len(sources) / seconds,
          'generated_tokens_per_s': generated / seconds,
          'mean_generated_tokens': generated / len(sources),
          'one_stage': {'first_pass_s': one_first_s, 'seconds': one_seconds,
                        'sentences_per_s': len(sources) / one_seconds,
                        'row_steps_after_the_end': 1 - needed / spent,
                        'same_translations': one_outputs == outputs},
          'speed_up_over_one_stage': one_seconds / seconds}, config


# CTranslate2's configuration for throughput on a CPU (its docs/parallel.md):
# one worker per core, each on one thread, translate_batch's batches spread
# over them; as the project's search runs one device per core. One worker on
# every core (intra_threads=os.cpu_count(), this benchmark's until
# 2026-12-07) was 2.7x slower on the test lines on a 2-core CPU of this
# project's kind (5.1 s against 1.9 s; docs/performance.md).
CTRANSLATE2_THREADS = {'inter_threads': os.cpu_count(), 'intra_threads': 1}

# A whole CTranslate2 process, as a user serving the converted run writes it:
# argv: model folder, compute type, beam, length penalty, batch size, max
# decoding length, input file, output file.
_CTRANSLATE2_PROCESS = """
import os, sys
import ctranslate2, sentencepiece
folder, compute, beam, penalty, batch, limit, source, target = sys.argv[1:]
translator = ctranslate2.Translator(folder, compute_type=compute,
                                   inter_threads=os.cpu_count(),
                                   intra_threads=1)
vocab = sentencepiece.SentencePieceProcessor(
    model_file=os.path.join(folder, 'spm.model'))
lines = open(source, encoding='utf-8').read().split('\\n')[:-1]
pieces = [vocab.encode(line, out_type=str)[:int(limit) - 1] for line in lines]
results = translator.translate_batch(
    pieces, beam_size=int(beam), length_penalty=float(penalty),
    max_batch_size=int(batch), max_decoding_length=int(limit))
with open(target, 'w', encoding='utf-8') as f:
  f.writelines(vocab.decode(r.hypotheses[0]) + '\\n' for r in results)
"""


def _ctranslate2_results(translator, vocab, lines, beam, alpha, batch_size,
                         limit, hypotheses: int = 1):
  """CTranslate2's search of `lines`, as the process above makes it: its
  results, each with its `hypotheses` best."""
  pieces = [vocab.encode(line, out_type=str)[:limit - 1] for line in lines]
  return translator.translate_batch(
      pieces, beam_size=beam, length_penalty=alpha, max_batch_size=batch_size,
      max_decoding_length=limit, num_hypotheses=hypotheses)


def _ctranslate2_search(translator, vocab, lines, beam, alpha, batch_size,
                        limit):
  """CTranslate2's translations of `lines`, as the process above makes them."""
  return [vocab.decode(r.hypotheses[0]) for r in _ctranslate2_results(
      translator, vocab, lines, beam, alpha, batch_size, limit)]


def _rate(lines: int, seconds: list[float]) -> dict:
  median = statistics.median(seconds)
  return {'round_seconds': seconds, 'median_s': median,
          'sentences_per_s': lines / median}


# The programs each way translate_ids searches compiles: the module's jitted
# functions.
PROGRAMS = {'stages': ('_jit_first_stage', '_jit_later_stage'),
            'slots': ('_jit_start_slots', '_jit_fill', '_jit_advance')}


def counted_row_steps(runs, beams: int) -> dict:
  """Calls each of `runs` (translate_ids calls) with the search's programs
  wrapped to count the beam row-steps they take: -> {'row_steps':
  {'stages': n, 'slots': n}, 'own_steps': each sentence's own steps to its
  end, from the slots (refill=True) calls}."""
  counts = {'row_steps': {'stages': 0, 'slots': 0}, 'own_steps': []}
  jitted = {name: getattr(translation, name)
            for names in PROGRAMS.values() for name in names}
  first, later = jitted['_jit_first_stage'], jitted['_jit_later_stage']
  advance = jitted['_jit_advance']

  # A stage's step is int32[devices]: each device searches rows / devices
  # rows for its own number of steps.
  def stage_row_steps(rows, steps):
    return rows // len(steps) * beams * int(steps.sum())

  def first_stage(params, src, **static):
    state, context = first(params, src, **static)
    counts['row_steps']['stages'] += stage_row_steps(
        len(src), np.asarray(state.step))
    return state, context

  def later_stage(params, state, context, keep, **static):
    step = np.asarray(state.step)
    state, context = later(params, state, context, keep, **static)
    counts['row_steps']['stages'] += stage_row_steps(
        len(keep), np.asarray(state.step) - step)
    return state, context

  def advance_slots(params, state, until_done, **static):
    step, done = np.asarray(state.step), np.asarray(state.done)
    state = advance(params, state, until_done, **static)
    new_step, new_done = np.asarray(state.step), np.asarray(state.done)
    # Every slot steps while one searches: the loop ran as many times as
    # the slot that stepped most.
    counts['row_steps']['slots'] += (len(step) * beams *
                                     int((new_step - step).max()))
    counts['own_steps'].extend(new_step[new_done & ~done].tolist())
    return state

  translation._jit_first_stage = first_stage  # pylint: disable=protected-access
  translation._jit_later_stage = later_stage  # pylint: disable=protected-access
  translation._jit_advance = advance_slots  # pylint: disable=protected-access
  try:
    for run in runs:
      run()
  finally:
    for name, function in jitted.items():
      setattr(translation, name, function)
  return counts


def _ctranslate2_row_steps(translator, vocab, lines, beam, alpha, batch_size,
                           limit) -> tuple[int | None, list[str]]:
  """The beam row-steps CTranslate2's search takes on `lines` (None where
  its output cannot show them), and its best translations: -> (row-steps,
  translations).

  With a length penalty CTranslate2 ends a sentence once beam_size
  hypotheses have ended (without one, once its top beam has, which its
  output does not show), so the longest of the beam_size it returns ended
  at its last step; it drops each ended sentence from its batch at once,
  and on a CPU takes the first step on one row per sentence, expanding to
  the beams after it (its decoding.cc).
  """
  results = _ctranslate2_results(translator, vocab, lines, beam, alpha,
                                 batch_size, limit, hypotheses=beam)
  # A hypothesis of n tokens ended (eos) at step n + 1, or was cut at the
  # limit after n = limit steps.
  steps = [min(max(map(len, r.hypotheses)) + 1, limit) for r in results]
  row_steps = sum(beam * n - (beam - 1) for n in steps) if alpha else None
  return row_steps, [vocab.decode(r.hypotheses[0]) for r in results]


def against_ctranslate2(workdir: str, data_dir: str, beam: int,
                        batch_size: int, rounds: int, train_lines: int,
                        stopping: str | None) -> dict:
  """The project's search and command against CTranslate2 on the same
  weights: the searches in this process, then whole processes, in turns;
  the project's under `stopping` (None: the run's rule)."""
  import ctranslate2  # pylint: disable=g-import-not-at-top
  import sacrebleu  # pylint: disable=g-import-not-at-top
  from flaxformer_mini import to_ctranslate2  # pylint: disable=g-import-not-at-top
  trained = workdir_lib.load_run(workdir)
  config, vocab = trained.config, trained.tokenizer
  alpha, limit = config.eval_alpha, config.max_len
  stopping = config.eval_stopping if stopping is None else stopping
  test = split_lines(data_dir, config, 'test_2016_flickr')
  references = split_lines(data_dir, config, 'test_2016_flickr', side=1)
  train = split_lines(data_dir, config, 'train')[:train_lines]
  scratch = tempfile.mkdtemp(prefix='translate-bench-')
  folder = os.path.join(scratch, 'ct2')
  pieces = [vocab.id_to_piece(i) for i in range(vocab.get_piece_size())]
  to_ctranslate2.convert(trained.params, config, pieces, folder,
                         files=(os.path.join(workdir, 'spm.model'),))

  def scored(outputs: list[str], project: list[str]) -> dict:
    return {'bleu': sacrebleu.corpus_bleu(outputs, [references]).score,
            'same_as_project': sum(a == b for a, b in zip(outputs, project))}

  # The searches alone, in this process: the project's and CTranslate2's in
  # float32. One translator only: a second one in the process (int8, or
  # even one created and deleted before) halves the first's speed on this
  # 2-core CPU (measured: 3.2 s for the test lines alone, 6.8 s beside
  # another), so int8 runs in its own process below.
  sources = [vocab.encode(line) for line in test]
  translator = ctranslate2.Translator(folder, compute_type='float32',
                                      **CTRANSLATE2_THREADS)
  searched_as = lambda config: lambda: [vocab.decode(ids) for ids in
                                        translate_ids(
      trained.params, config, sources, beam_size=beam, batch_size=batch_size,
      stopping=stopping)]
  runs = {
      'project': searched_as(config),
      # The same run searched in bfloat16 (the command's --dtype=bfloat16).
      'project_bfloat16': searched_as(config.replace(dtype='bfloat16')),
      'ctranslate2_float32': functools.partial(
          _ctranslate2_search, translator, vocab, test, beam, alpha,
          batch_size, limit)}
  outputs = {name: run() for name, run in runs.items()}  # compiles ours
  times = common.interleaved_seconds(runs, rounds)
  searches = {name: {**_rate(len(test), times[name]),
                     **scored(outputs[name], outputs['project'])}
              for name in runs}
  theirs = times['ctranslate2_float32']
  for name in ('project', 'project_bfloat16'):
    searches[f'{name}_over_ctranslate2_float32'] = {
        'per_round': [t / m for m, t in zip(times[name], theirs)],
        'of_medians': statistics.median(theirs) / statistics.median(
            times[name])}

  # Where the gap between the searches is: the beam row-steps each takes
  # (the project's against every sentence's own steps to its end, counted
  # in slots, which step each sentence alone) and each row-step's time.
  counts = counted_row_steps((runs['project'], lambda: translate_ids(
      trained.params, config, sources, beam_size=beam, batch_size=batch_size,
      stopping=stopping, refill=True)), beam)
  theirs, theirs_best = _ctranslate2_row_steps(
      translator, vocab, test, beam, alpha, batch_size, limit)
  row_steps = {'project': counts['row_steps']['stages'],
               'project_own': beam * sum(counts['own_steps']),
               'ctranslate2_float32': theirs}
  searches['row_steps'] = {
      **row_steps,
      # The search counted is the one timed: the same translations.
      'ctranslate2_same_output': sum(a == b for a, b in zip(
          theirs_best, outputs['ctranslate2_float32'])),
      'microseconds_per_row_step': {
          name: 1e6 * searches[name]['median_s'] / row_steps[name]
          for name in row_steps if name in runs and row_steps[name]}}

  # Whole processes, in turns.
  processes = {}
  for name, lines in (('test', test), ('train', train)):
    source = os.path.join(scratch, f'{name}.txt')
    with open(source, 'w', encoding='utf-8') as f:
      f.writelines(line + '\n' for line in lines)
    cache = os.path.join(scratch, f'xla-{name}')
    command = [sys.executable, '-m', 'flaxformer_mini.translate',
               f'--workdir={workdir}', f'--input={source}',
               f'--beam_size={beam}', f'--batch_size={batch_size}',
               f'--stopping={stopping}']
    # What each kind of process writes: the command to its stdout, a
    # CTranslate2 process to the file it is given.
    target = lambda kind: os.path.join(scratch, f'{name}-{kind}.txt')
    def ctranslate2_process(compute):
      return [sys.executable, '-c', _CTRANSLATE2_PROCESS, folder, compute,
              str(beam), str(alpha), str(batch_size), str(limit), source,
              target(f'ctranslate2_{compute}')]
    seconds = {'command_cold': [], 'command_warm': [],
               'command_cold_bfloat16': [], 'command_warm_bfloat16': [],
               'ctranslate2_float32': [], 'ctranslate2_int8': []}
    # What a command writes: command.txt, or command_bfloat16.txt.
    written_by = lambda kind: kind.replace('_cold', '').replace('_warm', '')
    for _ in range(rounds):
      for kind in seconds:
        if kind.startswith('command_cold'):
          shutil.rmtree(cache, ignore_errors=True)
        argv = (command + [f'--compilation_cache={cache}'] +
                (['--dtype=bfloat16'] if kind.endswith('bfloat16') else [])
                if kind.startswith('command') else
                ctranslate2_process(kind.split('_')[1]))
        start = time.perf_counter()
        with (open(target(written_by(kind)), 'w', encoding='utf-8')
              if kind.startswith('command') else
              contextlib.nullcontext(subprocess.DEVNULL)) as out:
          subprocess.run(argv, check=True, stdout=out,
                         stderr=subprocess.DEVNULL)
        seconds[kind].append(time.perf_counter() - start)
    programs = sum(f.endswith('.executable') for f in os.listdir(cache))
    processes[name] = {'lines': len(lines), 'programs': programs, **{
        kind: _rate(len(lines), times_) for kind, times_ in seconds.items()}}
    if name == 'test':  # what each process wrote, against the references
      for timed in seconds:
        with open(target(written_by(timed)), encoding='utf-8') as f:
          written = f.read().split('\n')[:-1]
        processes[name][timed].update(scored(written, outputs['project']))
    processes[name]['warm_over_ctranslate2_float32'] = (
        processes[name]['ctranslate2_float32']['median_s'] /
        processes[name]['command_warm']['median_s'])
  shutil.rmtree(scratch)
  import jax  # pylint: disable=g-import-not-at-top
  return {'beam': beam, 'alpha': alpha, 'batch_size': batch_size,
          'devices': jax.local_device_count(),
          'ctranslate2_threads': CTRANSLATE2_THREADS,
          'stopping': stopping, 'runs_stopping': config.eval_stopping,
          'rounds': rounds,
          'searches': searches, 'processes': processes}


def ctranslate2_table(result: dict) -> str:
  """docs/performance.md's table of against_ctranslate2's result."""
  env = result['environment']
  c = result['ctranslate2']
  s, p = c['searches'], c['processes']
  lines = [
      common.measured_by(env, 'benchmarks/translate_command.py --workdir=W '
                         '--ctranslate2 --write_docs') +
      f"beam {c['beam']}, α {c['alpha']} (CTranslate2's "
      f"length_penalty {c['alpha']}), batches of {c['batch_size']} (the "
      f"project's: {c['batch_size']} per device on {c['devices']} "
      f"device(s), one per core; CTranslate2's: "
      + ', '.join(f'{k} {v}' for k, v in c['ctranslate2_threads'].items()) +
      f"), the stopping rule {c['stopping']} ("
      + ("the run's" if c['stopping'] == c.get('runs_stopping', c['stopping'])
         else f"the run's is {c['runs_stopping']}") +
      f"); medians of {c['rounds']} rounds in turns.", '',
      '| what | input | sentences/s | project ÷ CTranslate2 float32 | BLEU | '
      'same output as the project |', '|---|---|---:|---:|---:|---:|']
  for name, label in (('project', 'the search alone, this project'),
                      ('project_bfloat16', 'the search alone, this project '
                       'in bfloat16'),
                      ('ctranslate2_float32', 'CTranslate2 float32, search '
                       'alone')):
    ratio = s.get(f'{name}_over_ctranslate2_float32', {}).get('of_medians')
    same = ('—' if name == 'project' else
            f"{s[name]['same_as_project']:,}")
    lines.append(
        f"| {label} | {p['test']['lines']:,} test lines | "
        f"{s[name]['sentences_per_s']:.0f} | "
        f"{f'{ratio:.2f}x' if ratio else ''} | "
        f"{s[name]['bleu']:.2f} | "
        f"{same} |")
  for split in ('test', 'train'):
    q = p[split]
    for kind, label in (('command_cold', 'the command, cold process'),
                        ('command_warm', 'the command, warm process'),
                        ('command_cold_bfloat16', 'the command in bfloat16, '
                         'cold process'),
                        ('command_warm_bfloat16', 'the command in bfloat16, '
                         'warm process'),
                        ('ctranslate2_float32', 'CTranslate2 float32, process'),
                        ('ctranslate2_int8', 'CTranslate2 int8, process')):
      ratio = (q['ctranslate2_float32']['median_s'] / q[kind]['median_s']
               if kind.startswith('command') else None)
      scores = (f"{q[kind]['bleu']:.2f} | {q[kind]['same_as_project']:,}"
                if 'bleu' in q[kind] else ' | ')
      lines.append(
          f"| {label} | {q['lines']:,} {split} lines | "
          f"{q[kind]['sentences_per_s']:.0f} | "
          f"{f'{ratio:.2f}x' if ratio else ''} | {scores} |")
  lines += ['', *_row_steps_table(s, p['test']['lines'])]
  lines += ['', f"The command's compiled programs, kept whole by the cold "
            f"process and loaded by the warm one: {p['test']['programs']} "
            f"for the test lines, {p['train']['programs']} for the train "
            'lines. The command writes its output once every line is '
            'translated, so its time is also the time to its first line.']
  return '\n'.join(lines)


def _row_steps_table(searches: dict, lines: int) -> list[str]:
  """The searches' gap on the test lines as beam row-steps times the time
  of one: the lines of a table and a sentence."""
  r = searches['row_steps']
  per = r['microseconds_per_row_step']
  mine, own = r['project'], r['project_own']
  theirs = r['ctranslate2_float32']
  table = [f'| the search alone, {lines:,} test lines | beam row-steps | '
           'µs per row-step (wall, every core) |', '|---|---:|---:|',
           f"| this project | {mine:,} ({mine / own - 1:+.0%} over its "
           f"sentences' own, {own:,}) | {per['project']:.0f} |"]
  if not theirs:
    return table + ['', "CTranslate2's row-steps are not counted: without a "
                    'length penalty it ends a sentence at its top beam\'s '
                    'end, which its output does not show.']
  steps, cost = mine / theirs, per['project'] / per['ctranslate2_float32']
  return table + [
      f"| CTranslate2 float32 | {theirs:,} | "
      f"{per['ctranslate2_float32']:.0f} |",
      f'| project ÷ CTranslate2 | {steps:.2f}x | {cost:.2f}x |', '',
      f'So the project\'s search takes {steps:.2f} × {cost:.2f} = '
      f'{steps * cost:.2f}× CTranslate2\'s time: its stages step ended '
      "sentences along until a quarter of a batch's are left (the row-steps "
      "over its sentences' own), where CTranslate2 drops each sentence at its"
      ' end and takes its first step on one row per sentence; the rest is '
      "each row-step's cost. CTranslate2's row-steps are read from its "
      'beam_size hypotheses (it ends a sentence once beam_size have ended), '
      f"in a search that gave {r['ctranslate2_same_output']:,} of "
      f'{lines:,} translations the same as the timed one.']


DOCS = os.path.join(ROOT, 'docs', 'performance.md')
MARKERS = ('<!-- ctranslate2:start -->', '<!-- ctranslate2:end -->')


def run_parser(description: str, rounds: int) -> argparse.ArgumentParser:
  """The flags of a benchmark of a trained run: --workdir, --data_dir,
  --rounds and --write_docs; the caller adds its own. Called before JAX
  starts, it also gives the benchmark the translate command's devices (one
  per core on a CPU host), so that it searches as the command does."""
  translate._one_device_per_core()  # pylint: disable=protected-access
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument('--workdir', required=True,
                      help='a trained translation workdir')
  parser.add_argument('--data_dir', default=MULTI30K)
  parser.add_argument('--rounds', type=int, default=rounds)
  parser.add_argument('--write_docs', action='store_true')
  return parser


def report(measured: dict, table, markers: tuple[str, str],
           write: bool) -> None:
  """Prints a benchmark's JSON (with the machine's description) and, where
  `write`, table(result) between `markers` in docs/performance.md."""
  result = {'environment': common.environment(), **measured}
  common.emit(result)
  if write:
    write_docs(table(result), markers)


def write_docs(table: str, markers: tuple[str, str] = MARKERS) -> None:
  """Replaces the table between `markers` in docs/performance.md."""
  with open(DOCS, encoding='utf-8') as f:
    text = f.read()
  head, rest = text.split(markers[0], 1)
  _, tail = rest.split(markers[1], 1)
  with open(DOCS, 'w', encoding='utf-8') as f:
    f.write(f'{head}{markers[0]}\n{table}\n{markers[1]}{tail}')


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--workdir', help='a trained translation workdir')
  parser.add_argument('--data_dir', default=MULTI30K)
  parser.add_argument('--split', default='test_2016_flickr')
  parser.add_argument('--beam', type=int, default=4)
  parser.add_argument('--batch_size', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--no_baseline', action='store_true')
  parser.add_argument('--ctranslate2', action='store_true',
                      help='also against CTranslate2 (needs --workdir)')
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--train_lines', type=int, default=5000)
  parser.add_argument('--stopping', choices=STOPPING_RULES,
                      help="the project's stopping rule (default: the run's)")
  parser.add_argument('--write_docs', action='store_true')
  args = parser.parse_args()
  if args.ctranslate2 and not args.workdir:
    parser.error('--ctranslate2 compares on a trained run: give --workdir.')
  # One JAX device per core, as the translate command makes them (before
  # JAX starts): the project's searches below run as the command's do.
  translate._one_device_per_core()  # pylint: disable=protected-access
  result = {'benchmark': 'translate'}
  if args.workdir:
    result['command'], config = translate_command(
        args.workdir, args.data_dir, args.split, args.beam, args.batch_size,
        args.stopping)
    gen_len = int(round(result['command']['mean_generated_tokens']))
  else:
    config, gen_len = get_config('multi30k'), 16
  config = config.replace(dropout_rate=0.0)
  # Multi30k's sources and targets are about as long; an untrained model
  # can run to the length limit.
  gen_len = src_len = min(gen_len, config.max_len - 1)
  params, src = decode_bench.random_model_and_sources(config, args.batch_size,
                                                      src_len)
  baseline = None if args.no_baseline else decode_bench.flax_wmt_params(config)
  result['search'] = {
      'batch': args.batch_size, 'src_len': src_len, 'gen_len': gen_len,
      **decode_bench.measure(config, params, baseline, src, args.beam,
                             min(gen_len, decoding.default_max_len(
                                 config, src_len)), args.repeats)}
  if args.ctranslate2:
    result['ctranslate2'] = against_ctranslate2(
        args.workdir, args.data_dir, args.beam, args.batch_size, args.rounds,
        args.train_lines, args.stopping)
  common.emit(result)
  if args.write_docs and args.ctranslate2:
    write_docs(ctranslate2_table({**result,
                                  'environment': common.environment()}))


if __name__ == '__main__':
  main()
