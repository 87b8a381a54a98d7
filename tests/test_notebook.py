"""The Colab notebook runs top to bottom (on CPU, with its quick settings)."""

import os

import nbformat
from nbclient import NotebookClient

from conftest import MULTI30K, ROOT

NOTEBOOK = os.path.join(ROOT, 'colab', 'flaxformer_mini.ipynb')


def test_the_notebook_runs_top_to_bottom(tmp_path, request, monkeypatch):
  monkeypatch.setenv('FLAXFORMER_MINI_NOTEBOOK_QUICK', '1')
  monkeypatch.setenv('FLAXFORMER_MINI_WORKDIR', str(tmp_path / 'runs'))
  monkeypatch.setenv('FLAXFORMER_MINI_DOWNLOAD', '0')  # CI has no internet
  if os.path.isdir(MULTI30K):
    monkeypatch.setenv('FLAXFORMER_MINI_DATA_DIR',
                       str(request.getfixturevalue('data_slice')))
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(notebook, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': str(tmp_path)}})
  client.execute()  # raises CellExecutionError, with the cell, on any error
  outputs = '\n'.join(
      output.get('text', '') for cell in notebook.cells
      if cell.cell_type == 'code' for output in cell.outputs)
  assert 'the model computed exactly this' in outputs
  assert 'input and output shapes agree at every layer' in outputs
  assert 'position 0 unchanged: True' in outputs
  assert 'exact match 1.0' in outputs
  images = [o for cell in notebook.cells if cell.cell_type == 'code'
            for o in cell.outputs if 'image/png' in o.get('data', {})]
  assert len(images) >= 6  # loss, schedule, curves, three heatmaps
  if os.path.isdir(MULTI30K):
    assert 'sacreBLEU' in outputs
