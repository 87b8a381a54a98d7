"""Every task of train.py's table (tasks.TASKS), by construction.

A task is a row of the table; each is run here for a few steps from its
own preset, through the table as train.py runs it, and must record its
name in its checkpoints and its results (a run is its task and its config:
another task's workdir is refused, run.resume_or_start). A new task is tested
by adding its row.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import MULTI30K, ROOT
from flaxformer_mini import checkpoints
from flaxformer_mini.config import get_config
from flaxformer_mini.tasks import TASKS


def test_the_readme_and_help_name_each_tasks_preset_from_the_table():
  help_text = ' '.join(subprocess.run(
      [sys.executable, os.path.join(ROOT, 'train.py'), '--help'],
      capture_output=True, text=True, check=True).stdout.split())
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    readme = ' '.join(f.read().split())
  for name, task in TASKS.items():
    assert f'{task.preset} for --task={name}' in help_text
    said = re.findall(rf'`python train.py --task={name}[^`]*` \(the `(\w+)`'
                      r' preset', readme)
    assert said and set(said) == {task.preset}, (name, said)


def _tiny(preset: str):
  """The task's preset, shrunk to train a few steps in seconds."""
  return get_config(preset).replace(
      src_vocab_size=300, tgt_vocab_size=300, d_model=16, d_ff=32,
      num_heads=2, num_encoder_layers=1, num_decoder_layers=1, max_len=48,
      tokens_per_batch=1536, batch_size=16, copy_length=4, train_steps=4,
      log_every=2, eval_every=4, checkpoint_every=2, keep_checkpoints=2,
      average_last=2, eval_beam_size=1)


@pytest.mark.slow  # whole runs, if short ones
@pytest.mark.parametrize('name', list(TASKS))
def test_every_task_trains_from_the_table_and_records_its_name(
    name, request, tmp_path):
  task = TASKS[name]
  data = {}
  if task.reads_text:
    if not os.path.isdir(MULTI30K):
      pytest.skip(f'Multi30k is not at {MULTI30K}')
    data = {'data_dir': str(request.getfixturevalue('data_slice'))}
  results = task.run(_tiny(task.preset), str(tmp_path), **data)
  assert results['task'] == name and results['steps'] == 4
  assert json.loads((tmp_path / 'results.json').read_text())['task'] == name
  with checkpoints.Checkpoints(str(tmp_path / 'checkpoints')) as saved:
    assert saved.steps() == [2, 4]
    assert {saved.read_meta(step)['task'] for step in saved.steps()} == {name}
