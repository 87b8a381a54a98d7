"""The export command: a run's search, loaded by a program that cannot import
flaxformer_mini or flax, translates as the translate command does."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, multi30k_lines

# Whole commands in subprocesses; jax.export changes with JAX: on every leg.
pytestmark = [pytest.mark.slow, pytest.mark.versions]

# The consumer: jax, numpy and sentencepiece only (importing flaxformer_mini,
# flax, optax or orbax fails). It pads as the translate command does.
_CONSUMER = textwrap.dedent('''
    import importlib.abc, json, sys
    class Refuse(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('flaxformer_mini', 'flax', 'optax', 'orbax'):
          raise ImportError(f'{name} may not be imported here')
    sys.meta_path.insert(0, Refuse())

    from jax import export
    import numpy as np, sentencepiece
    folder, lines = sys.argv[1], sys.stdin.read().split('\\n')[:-1]
    exported = export.deserialize(
        open(f'{folder}/search.jax_export', 'rb').read())
    params = list(np.load(f'{folder}/params.npz').values())
    signature = json.load(open(f'{folder}/signature.json'))
    vocab = sentencepiece.SentencePieceProcessor(model_file=f'{folder}/spm.model')
    eos, pad = signature['eos_id'], signature['pad_id']
    limit = signature['max_len']
    ids = [vocab.encode(line)[:limit - 1] for line in lines]
    # As the command pads one batch: the longest + eos, up to 16s, within
    # max_len (longer sentences cut to make room for eos).
    length = min(-(-(max(map(len, ids)) + 1) // 16) * 16, limit)
    src = np.full((len(ids), length), pad, np.int32)
    for row, sentence in enumerate(ids):
      src[row, :len(sentence) + 1] = sentence + [eos]
    tokens, scores, lengths, reached_eos = map(np.asarray, exported.call(params, src))
    assert tokens.shape == (len(ids), min(length + 50, signature['max_len']))
    for row in tokens:
      row = list(row)
      print(vocab.decode(row[:row.index(eos)] if eos in row else
                         [t for t in row if t != pad]))
    assert 'flaxformer_mini' not in sys.modules and 'flax' not in sys.modules
''')


def test_an_exported_search_translates_as_the_command_without_the_package(
    tiny_run, tmp_path):
  workdir, results = tiny_run
  out = tmp_path / 'exported'
  made = subprocess.run(
      [sys.executable, '-m', 'flaxformer_mini.export', f'--workdir={workdir}',
       f'--out={out}'], capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert made.returncode == 0, made.stderr[-3000:]
  assert sorted(os.listdir(out)) == ['params.npz', 'search.jax_export',
                                     'signature.json', 'spm.model']
  signature = json.loads((out / 'signature.json').read_text())
  assert signature['platforms'] == ['cpu', 'cuda', 'tpu']
  assert (signature['alpha'], signature['stopping']) == (
      results['config']['eval_alpha'], results['config']['eval_stopping'])
  lines = multi30k_lines('test_2016_flickr', 'de', 12)
  text = ''.join(line + '\n' for line in lines)
  command = subprocess.run(
      [sys.executable, '-m', 'flaxformer_mini.translate',
       f'--workdir={workdir}', '--batch_size=64', '--compilation_cache='],
      input=text, capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert command.returncode == 0, command.stderr[-3000:]
  consumer = subprocess.run(
      [sys.executable, '-c', _CONSUMER, str(out)], input=text,
      capture_output=True, text=True, cwd=tmp_path, timeout=600,
      env=dict(os.environ, PYTHONPATH=''))
  assert consumer.returncode == 0, consumer.stderr[-3000:]
  assert consumer.stdout == command.stdout
  assert len(consumer.stdout.split('\n')) == len(lines) + 1


def test_export_refuses_an_out_that_exists_or_cannot_be_made_in_one_line(
    tiny_run, tmp_path):
  workdir, _ = tiny_run
  for target in (tmp_path / 'file', tmp_path / 'earlier'):
    if target.name == 'file':
      target.write_text('x')
    else:
      target.mkdir()
      (target / 'search.jax_export').write_text('an earlier export')
    result = subprocess.run(
        [sys.executable, '-m', 'flaxformer_mini.export',
         f'--workdir={workdir}', f'--out={target}'],
        capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr == (
        f'python -m flaxformer_mini.export: error: --out={target} exists; '
        'name a new folder (nothing there was changed).\n')
  under_a_file = tmp_path / 'file' / 'exported'
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_mini.export', f'--workdir={workdir}',
       f'--out={under_a_file}'], capture_output=True, text=True, cwd=ROOT)
  assert result.returncode == 2
  assert result.stderr == (
      f'python -m flaxformer_mini.export: error: --out={under_a_file}: cannot '
      'be written (Not a directory).\n')
  assert (tmp_path / 'file').read_text() == 'x'
  assert os.listdir(tmp_path / 'earlier') == ['search.jax_export']
  assert (tmp_path / 'earlier' / 'search.jax_export').read_text() == (
      'an earlier export')
