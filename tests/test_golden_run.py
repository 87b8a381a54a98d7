"""A run trained by an earlier version still loads, translates and resumes.

tests/data/run_e577ba4 is a small translation run written by commit e577ba4
(its make.py says how; 2 micro-batches per update, so its optimizer state is
that version's optax.MultiSteps layout), with what that version made of it.
Every later layout change must keep these equal, or convert, or refuse in
one line: as T5X keeps golden parameter layouts, this keeps a golden run.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from flaxformer_mini import decoding, translation, workdir

GOLDEN = os.path.join(ROOT, 'tests', 'data', 'run_e577ba4')


def _expected() -> dict:
  with open(os.path.join(GOLDEN, 'expected.json'), encoding='utf-8') as f:
    return json.load(f)


def _test_sources() -> list[str]:
  with open(os.path.join(GOLDEN, 'data', 'test_2016_flickr.de'),
            encoding='utf-8') as f:
    return f.read().splitlines()


def _translate(run) -> list[str]:
  """The test sources translated as e577ba4 ranked hypotheses: a cut one
  (no eos by max_len) by its score among those that reached eos."""
  return translation.translate_lines(
      run.params, run.config, run.tokenizer, _test_sources(), beam_size=4,
      alpha=run.config.eval_alpha, finished_first=False)


@pytest.mark.parametrize('which', ['best', 'latest', 'averaged'])
def test_an_e577ba4_run_loads_and_translates_to_the_same_tokens(which):
  run = workdir.load_run(os.path.join(GOLDEN, 'workdir'), which)
  then = _expected()['translations'][which]
  assert _translate(run) == then
  # Today's default ranks every hypothesis that reached eos first: only the
  # lines whose best was cut at max_len (a runaway repeat) may change.
  now = translation.translate_lines(
      run.params, run.config, run.tokenizer, _test_sources(), beam_size=4,
      alpha=run.config.eval_alpha)
  for line_now, line_then in zip(now, then):
    assert line_now == line_then or len(run.tokenizer.encode(line_then)) >= (
        decoding.default_max_len(run.config, 16) - 1), (line_now, line_then)


@pytest.mark.slow
def test_an_e577ba4_run_resumes_as_that_version_resumed_it(tmp_path):
  """Two steps from step 200 of its MultiSteps-state checkpoint: the first
  loss is the restored parameters' (exact), the second follows an update
  made with the restored Adam moments (a fresh Adam state would move the
  parameters by the full learning rate), and the translations after it."""
  expected = _expected()
  shutil.copytree(os.path.join(GOLDEN, 'data'), tmp_path / 'data')
  shutil.copytree(os.path.join(GOLDEN, 'workdir'), tmp_path / 'run')
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'train.py'), *expected['flags'],
       '--train_steps=202', '--log_every=1', f'--workdir={tmp_path / "run"}',
       f'--data_dir={tmp_path / "data"}'],
      capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'resuming from step 200' in done.stdout
  results = json.loads((tmp_path / 'run' / 'results.json').read_text())
  resumed = expected['resumed']
  assert results['resumed_from'] == resumed['resumed_from'] == 200
  first, second = results['history']
  then_first, then_second = resumed['history']
  assert (first['step'], second['step']) == (201, 202)
  assert first['loss'] == pytest.approx(then_first['loss'], rel=1e-6)
  # The same update up to float32 rounding (the gradients are summed in
  # another order than optax.MultiSteps summed them).
  assert second['loss'] == pytest.approx(then_second['loss'], rel=1e-5)
  run = workdir.load_run(str(tmp_path / 'run'), 'latest')
  assert _translate(run) == resumed['translations']


@pytest.mark.parametrize('which', ['average', 'Latest', ''])
def test_an_unknown_choice_of_parameters_is_refused_naming_the_allowed(which):
  """'average' once returned the latest parameters labelled 'average'."""
  with pytest.raises(ValueError, match=(
      rf"^which={which!r}: allowed values: best, latest, averaged.$")):
    workdir.load_run(os.path.join(GOLDEN, 'workdir'), which)
