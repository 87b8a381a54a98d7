"""The Colab notebook runs top to bottom (on CPU, with its quick settings).

It runs in the dtype FLAXFORMER_MINI_NOTEBOOK_DTYPE names (default float32);
CI's colab leg runs it in bfloat16 too, as a TPU computes. Every claim the
notebook makes is an assert in its cells, so a cell that runs is a claim
that holds.
"""

import os

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import MULTI30K, ROOT

pytestmark = pytest.mark.slow
NOTEBOOK = os.path.join(ROOT, 'colab', 'flaxformer_mini.ipynb')


def test_the_notebook_runs_top_to_bottom(tmp_path, request, monkeypatch):
  dtype = os.environ.get('FLAXFORMER_MINI_NOTEBOOK_DTYPE', 'float32')
  monkeypatch.setenv('FLAXFORMER_MINI_NOTEBOOK_QUICK', '1')
  monkeypatch.setenv('FLAXFORMER_MINI_WORKDIR', str(tmp_path / 'runs'))
  monkeypatch.setenv('FLAXFORMER_MINI_DOWNLOAD', '0')  # CI has no internet
  if os.path.isdir(MULTI30K):
    monkeypatch.setenv('FLAXFORMER_MINI_DATA_DIR',
                       str(request.getfixturevalue('data_slice')))
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(notebook, timeout=900, kernel_name='python3',
                          resources={'metadata': {'path': str(tmp_path)}})
  client.execute()  # raises CellExecutionError, with the cell, on any error
  outputs = '\n'.join(
      output.get('text', '') for cell in notebook.cells
      if cell.cell_type == 'code' for output in cell.outputs)
  assert f'model dtype {dtype}' in outputs
  for claim in ('the model computed exactly this',
                'input and output shapes agree at every layer',
                'position 0 unchanged: True', 'without the mask:',
                'full prefix vs one token + cache', 'beam 2:',
                "the full model's log p", 'toy: exact match 1.0',
                'without positions: permuted input',
                'on no later one', 'the library agrees at both steps',
                'the cache holds the keys and values of one teacher-forced pass',
                'position by position', 'they part at output position',
                'one fixed rotation of PE[p]',
                'post-norm, LayerNorm(x + Sublayer(x))', 'pre-norm: the block returns',
                'and its Add & Norm after it', 'one parameter, three uses',
                'embeddings + positions (dropout_rate)', 'the update is the gradient of that per-token mean',
                'contributes nothing to the loss', 'peak at step 4000',
                'zero up to', 'each position now depends on the later ones',
                'the trained copy model: beam 2 and greedy agree', 'tokens copied right'):
    assert claim in outputs, claim
  images = [o for cell in notebook.cells if cell.cell_type == 'code'
            for o in cell.outputs if 'image/png' in o.get('data', {})]
  assert len(images) >= 8  # Figure 1, loss, schedule, the copy run's curves, 4 attention maps
  for drawing in ('plots.figure_one(', 'plots.attention_heatmaps('):  # each shown as a picture
    cell = next(c for c in notebook.cells if drawing in c.source)
    assert any('image/png' in o.get('data', {}) for o in cell.outputs), drawing
  if os.path.isdir(MULTI30K):
    assert 'lowercased' in outputs and 'pieces' in outputs
    assert 'the same pieces and ids, sides traded' in outputs
    assert 'QUICK: 2 steps by design' in outputs  # an untrained model, said so
