"""What colab/build.py derives from the notebook stays in step with it.

The notebook's executed copy must hold the notebook's own cells (so it is
regenerated whenever a cell changes), and the repository's address, written
once in pyproject.toml, must reach the notebook's REPO_URL and the badges.
"""

import os
import subprocess
import sys

import nbformat
import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, 'colab'))
import build  # pylint: disable=g-import-not-at-top,wrong-import-position

URL = 'https://github.com/someone/flaxformer_mini'
COLAB_URL = ('https://colab.research.google.com/github/someone/flaxformer_mini/blob/main/'
             'colab/flaxformer_mini.ipynb')


def test_the_notebook_its_executed_copy_and_the_readme_agree():
  checked = subprocess.run([sys.executable, os.path.join(ROOT, 'colab', 'build.py'), '--check'],
                           capture_output=True, text=True, check=False)
  assert checked.returncode == 0, checked.stderr


def test_a_changed_text_cell_makes_the_executed_copy_stale(tmp_path, monkeypatch):
  notebook = nbformat.read(build.NOTEBOOK, as_version=4)
  text = next(cell for cell in notebook.cells if cell.cell_type == 'markdown')
  text.source += '\n\nOne more sentence.'
  changed = tmp_path / 'flaxformer_mini.ipynb'
  nbformat.write(notebook, str(changed))
  monkeypatch.setattr(build, 'NOTEBOOK', str(changed))
  with pytest.raises(SystemExit, match=r'flaxformer_mini.executed.ipynb \(its cells differ'):
    build.main(['--check'])


def test_the_repository_address_reaches_repo_url_and_both_badges():
  notebook = build.addressed_notebook(nbformat.read(build.NOTEBOOK, as_version=4), URL)
  install = next(c.source for c in notebook.cells if c.cell_type == 'code')
  assert f"REPO_URL = '{URL}'  # @param" in install
  assert COLAB_URL in notebook.cells[0].source
  with open(build.README, encoding='utf-8') as f:
    readme = build._with_badge(f.read(), URL)
  assert readme.split('\n')[readme.split('\n').index(build.BADGE_MARK) + 1].endswith(
      f'({COLAB_URL})')
  # Idempotent, and an unset address takes the badge away again.
  assert build._with_badge(readme, URL) == readme
  assert COLAB_URL not in build._with_badge(readme, '')
  again = build.addressed_notebook(notebook, '')
  assert "REPO_URL = ''  # @param" in next(
      c.source for c in again.cells if c.cell_type == 'code')
  assert 'colab.research.google.com/github' not in again.cells[0].source


def test_only_github_addresses_get_a_badge():
  assert build.badge(URL + '.git').endswith(f'({COLAB_URL})')
  assert build.badge('https://gitlab.com/someone/flaxformer_mini') == ''
  assert build.badge('') == ''


def test_colab_opens_it_on_a_tpu_with_a_form_for_each_setting():
  notebook = nbformat.read(build.NOTEBOOK, as_version=4)
  assert notebook.metadata.accelerator == 'TPU'
  assert notebook.metadata.colab.gpuType == 'V5E1'
  settings = next(c.source for c in notebook.cells if c.source.startswith('# @title Settings'))
  for name in ('DTYPE', 'QUICK', 'TRANSLATE_MINUTES', 'SRC_LANG', 'TGT_LANG', 'DATA_DIR'):
    assert any(line.startswith(f'{name} = ') and '# @param' in line
               for line in settings.split('\n')), name


def _install_cell(tmp_path, repo_url: str) -> subprocess.CompletedProcess:
  """The notebook's first cell, run where flaxformer_mini is not importable (python -S: no
  site-packages) and no clone is around (cwd tmp_path), as in a fresh Colab runtime."""
  notebook = nbformat.read(build.NOTEBOOK, as_version=4)
  cell = next(c.source for c in notebook.cells if c.cell_type == 'code')
  return subprocess.run([sys.executable, '-S', '-c', cell], cwd=tmp_path, capture_output=True,
                        text=True, check=False, timeout=300,
                        env={**os.environ, 'FLAXFORMER_MINI_REPO_URL': repo_url})


def test_the_install_cell_without_code_or_address_says_what_to_do(tmp_path):
  ran = _install_cell(tmp_path, '')
  assert ran.returncode == 1
  assert ran.stderr.strip().splitlines() == [
      'This notebook needs the flaxformer_mini code: open it from a clone of the project, or '
      'set REPO_URL in this cell to its git address and run it again.']


def test_the_install_cell_says_what_to_do_when_pip_cannot_install(tmp_path):
  ran = _install_cell(tmp_path, f'file://{tmp_path}/nowhere')
  assert ran.returncode == 1
  assert ran.stderr.strip().splitlines()[-1] == (
      f'pip could not install flaxformer_mini[translate] @ git+file://{tmp_path}/nowhere (its '
      'message is above): check the internet connection and REPO_URL, then run this cell again.')


def test_setup_and_for_the_curious_cells_are_colab_forms():
  """Colab shows a form cell's title and output, its code only on a double click."""
  notebook = nbformat.read(build.NOTEBOOK, as_version=4)
  titled = [c for c in notebook.cells if c.cell_type == 'code' and c.source.startswith('# @title')]
  assert {c.source.split('\n', 1)[0] for c in titled} >= {'# @title Install', '# @title Settings'}
  assert any('For the curious' in c.source.split('\n', 1)[0] for c in titled)
  assert all(c.metadata.get('cellView') == 'form' for c in titled)


def test_the_executed_copy_shows_a_trained_translator_and_no_machine():
  """The copy a GitHub reader sees: section 11 in full mode (no QUICK notice), no path of
  the machine that made it, no progress bars."""
  executed = nbformat.read(build.EXECUTED, as_version=4)
  texts = '\n'.join(output.get('text', '') + ''.join(output.get('data', {}).get('text/plain', ''))
                    for cell in executed.cells if cell.cell_type == 'code'
                    for output in cell.outputs)
  assert 'QUICK:' not in texts and 'trained ' in texts and 'epochs) within the' in texts
  for machine in (ROOT, '/tmp/', '/home/', 'site-packages', 'IProgress', 'step/s',
                  'Downloading and preparing'):
    assert machine not in texts, machine
  command = next(c for c in executed.cells if 'the translate command:' in c.source)
  said = ''.join(o.get('text', '') for o in command.outputs)
  translation = said.split('the translate command:', 1)[1].strip().strip("'\"")
  assert len(set(translation.split())) >= 4, said  # a sentence, not one piece repeated
