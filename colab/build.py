"""What the repository derives from the notebook: its address fields and its executed copy.

    python colab/build.py                       # the address into the notebook and the README
    python colab/build.py --execute DATA_DIR    # ... and the executed copy (full mode, CPU)
    python colab/build.py --execute DATA_DIR --quick   # ... in QUICK mode (minutes; a draft)
    python colab/build.py --check               # exit 1 naming what is out of date

The project's public git address lives in one place, pyproject.toml's
[project.urls] Repository. From it come the notebook's default REPO_URL and the
"Open in Colab" badges of the notebook and the README (GitHub addresses only;
none while the address is unset). The executed copy,
colab/flaxformer_mini.executed.ipynb, is the notebook run top to bottom on the
CPU with its outputs, so that it reads on GitHub without running: in full mode,
as a learner's Run all, so that section 11 shows a trained translator. DATA_DIR
is a folder of the Multi30k files (the real-sentence cells are skipped without
one: pass '' for that). The copy shows no progress bars, and no path of the
machine that made it: the scratch folder reads as the default WORKDIR, and
DATA_DIR as 'multi30k', the folder the notebook downloads into. The seconds
each section took are printed.
"""

import argparse
import copy
import os
import re
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, 'colab', 'flaxformer_mini.ipynb')
EXECUTED = os.path.join(ROOT, 'colab', 'flaxformer_mini.executed.ipynb')
README = os.path.join(ROOT, 'README.md')
BADGE_MARK = '<!-- colab-badge -->'
_REPO_URL_LINE = re.compile(r"^REPO_URL = '[^']*'(  # @param .*)$", re.MULTILINE)


def repository() -> str:
  """pyproject.toml's [project.urls] Repository, '' while it is unset."""
  with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
    return tomllib.load(f)['project'].get('urls', {}).get('Repository', '')


def badge(url: str) -> str:
  """The "Open in Colab" badge for the notebook of a GitHub repository ('' otherwise)."""
  found = re.fullmatch(r'https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?', url)
  if not found:
    return ''
  owner, name = found.groups()
  return (f'[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]'
          f'(https://colab.research.google.com/github/{owner}/{name}/blob/main/colab/'
          'flaxformer_mini.ipynb)')


def _with_badge(text: str, url: str) -> str:
  """text with the line after BADGE_MARK being the badge (or no line)."""
  lines = text.split('\n')
  at = lines.index(BADGE_MARK)
  if at + 1 < len(lines) and lines[at + 1].startswith('[![Open In Colab]'):
    del lines[at + 1]
  if badge(url):
    lines.insert(at + 1, badge(url))
  return '\n'.join(lines)


def addressed_notebook(notebook, url: str):
  """The notebook with REPO_URL's default and its badge set from url (in place)."""
  for cell in notebook.cells:
    if BADGE_MARK in cell.source:
      cell.source = _with_badge(cell.source, url)
    if _REPO_URL_LINE.search(cell.source):
      cell.source = _REPO_URL_LINE.sub(lambda m: f'REPO_URL = {url!r}{m.group(1)}', cell.source)
  return notebook


def cells(notebook) -> list[tuple[str, str]]:
  """(type, source) of every cell: what the executed copy must share with the notebook."""
  return [(cell.cell_type, cell.source) for cell in notebook.cells]


def execute(notebook, data_dir: str, quick: bool = False):
  """Runs the notebook on the CPU in a scratch folder; returns it with outputs."""
  from nbclient import NotebookClient  # pylint: disable=g-import-not-at-top
  data_dir = os.path.abspath(data_dir) if data_dir else ''
  settings = {'FLAXFORMER_MINI_NOTEBOOK_QUICK': '1' if quick else '0',
              'FLAXFORMER_MINI_DOWNLOAD': '0', 'FLAXFORMER_MINI_DATA_DIR': data_dir,
              'JAX_PLATFORMS': 'cpu',
              # Progress bars redraw; in a saved copy they are only noise.
              'TQDM_DISABLE': '1',
              # tqdm's notice that this kernel has no ipywidgets (Colab has them).
              'PYTHONWARNINGS': 'ignore:IProgress not found'}
  with tempfile.TemporaryDirectory() as scratch:
    settings['FLAXFORMER_MINI_WORKDIR'] = os.path.join(scratch, WORKDIR)
    os.environ.update(settings)
    # The kernel starts in a folder beside a clone, as a learner's would: it installs nothing.
    NotebookClient(notebook, timeout=3600, kernel_name='python3',
                   resources={'metadata': {'path': os.path.join(ROOT, 'colab')}}).execute()
    print(section_times(notebook))
    for cell in notebook.cells:
      cell.metadata.pop('execution', None)  # run times and dates would change every copy
      for output in cell.get('outputs', []):
        _without_paths(output, {scratch + os.sep: '', data_dir: 'multi30k'} if data_dir else
                       {scratch + os.sep: ''})
  return notebook


WORKDIR = 'runs/notebook'  # the notebook's default WORKDIR


def _without_paths(output, replacements: dict[str, str]) -> None:
  """Rewrites the machine's paths in one cell output (in place)."""
  def clean(text):
    for path, shown in replacements.items():
      text = text.replace(path, shown)
    return text
  if 'text' in output:
    output['text'] = clean(output['text'])
  for kind, value in output.get('data', {}).items():
    if kind.startswith('text/'):
      output['data'][kind] = clean(value)


def section_times(notebook) -> str:
  """Seconds each section ('## N.' headings) took, from nbclient's timestamps."""
  import datetime  # pylint: disable=g-import-not-at-top
  seconds, section = {}, 'setup'
  for cell in notebook.cells:
    if cell.cell_type == 'markdown' and cell.source.startswith('## '):
      section = cell.source.split('\n', 1)[0][3:].split('.', 1)[0]
    stamps = cell.metadata.get('execution', {})
    if 'iopub.execute_input' in stamps and 'shell.execute_reply' in stamps:
      taken = (datetime.datetime.fromisoformat(stamps['shell.execute_reply'].replace('Z', '+00:00')) -
               datetime.datetime.fromisoformat(stamps['iopub.execute_input'].replace('Z', '+00:00')))
      seconds[section] = seconds.get(section, 0.0) + taken.total_seconds()
  return ('seconds per section: ' + ', '.join(f'{k} {v:.0f}' for k, v in seconds.items()) +
          f'; total {sum(seconds.values()):.0f}')


def main(argv: list[str]) -> None:
  import nbformat  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--execute', metavar='DATA_DIR', default=None,
                      help="also rewrite the executed copy ('' for no Multi30k)")
  parser.add_argument('--quick', action='store_true',
                      help='execute in QUICK mode (a draft: section 11 is then untrained)')
  parser.add_argument('--check', action='store_true',
                      help='change nothing; exit 1 if anything is out of date')
  args = parser.parse_args(argv)
  url = repository()
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  with open(README, encoding='utf-8') as f:
    readme = f.read()
  wanted_notebook = addressed_notebook(copy.deepcopy(notebook), url)
  wanted_readme = _with_badge(readme, url)
  if args.check:
    stale = []
    if cells(wanted_notebook) != cells(notebook):
      stale.append(f'{NOTEBOOK} (its REPO_URL or badge)')
    if wanted_readme != readme:
      stale.append(f'{README} (its badge)')
    if (not os.path.isfile(EXECUTED) or
        cells(nbformat.read(EXECUTED, as_version=4)) != cells(notebook)):
      stale.append(f'{EXECUTED} (its cells differ from the notebook\'s)')
    if stale:
      sys.exit('out of date: ' + '; '.join(stale) + ': run python colab/build.py --execute DATA_DIR')
    print('the notebook, its executed copy and the README agree')
    return
  nbformat.write(wanted_notebook, NOTEBOOK)
  with open(README, 'w', encoding='utf-8') as f:
    f.write(wanted_readme)
  if args.execute is not None:
    nbformat.write(execute(wanted_notebook, args.execute, args.quick), EXECUTED)
    print(f'wrote {EXECUTED}')


if __name__ == '__main__':
  main(sys.argv[1:])
