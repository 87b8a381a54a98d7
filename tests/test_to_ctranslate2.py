"""Serving with CTranslate2: a run converted to its format is the same model.

The fast tests convert random weights of every layout the config can take
(post- and pre-norm, one table or three) and compare CTranslate2's
teacher-forced log-probabilities with Transformer.apply's; the slow ones run
the command on a trained run: greedy output token for token, and its
refusals in one line, nothing overwritten.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from flaxformer_mini import decoding
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.masks import padding_mask, target_mask
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import init_params

ctranslate2 = pytest.importorskip(
    'ctranslate2', reason="the ctranslate2 extra: pip install -e '.[ctranslate2]'")
# pylint: disable-next=g-import-not-at-top,wrong-import-position
from flaxformer_mini import to_ctranslate2

_PIECES = ['<pad>', '<s>', '</s>', '<unk>'] + [f'▁w{i}' for i in range(20)]


def _config(**changes) -> TransformerConfig:
  return TransformerConfig(
      src_vocab_size=len(_PIECES), tgt_vocab_size=len(_PIECES), d_model=16,
      d_ff=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
      max_len=24, **changes)


def _log_probs(params, config, src, tgt):
  """Transformer.apply's log p of each target token (then eos), teacher forced."""
  eos, bos, pad = config.eos_id, config.bos_id, config.pad_id
  width = max(map(len, src)) + 1
  src_ids = np.full((len(src), width), pad, np.int32)
  labels = np.full((len(tgt), max(map(len, tgt)) + 1), pad, np.int32)
  for i, (s, t) in enumerate(zip(src, tgt)):
    src_ids[i, :len(s) + 1] = s + [eos]
    labels[i, :len(t) + 1] = t + [eos]
  tgt_in = np.concatenate([np.full((len(tgt), 1), bos, np.int32),
                           labels[:, :-1]], axis=1)
  tgt_in = np.where(tgt_in == eos, pad, tgt_in)
  logits = Transformer(config).apply(
      {'params': params}, jnp.asarray(src_ids), jnp.asarray(tgt_in),
      padding_mask(src_ids, pad), target_mask(tgt_in, pad))
  log_probs = np.asarray(jax.nn.log_softmax(logits))
  return [log_probs[i, np.arange(len(t) + 1), labels[i, :len(t) + 1]]
          for i, t in enumerate(tgt)]


@pytest.mark.parametrize('changes', [
    {},
    {'pre_norm': True},
    {'share_embeddings': False, 'tie_output_embedding': False},
    {'pre_norm': True, 'share_embeddings': False, 'layer_norm_epsilon': 1e-5},
], ids=['paper', 'pre_norm', 'three_tables', 'pre_norm_two_tables'])
def test_ctranslate2_scores_as_the_model(changes, tmp_path):
  config = _config(**changes)
  params = init_params(config, jax.random.key(3))
  rng = np.random.default_rng(0)
  src = [list(rng.integers(4, len(_PIECES), size=n)) for n in (5, 9, 1, 12)]
  tgt = [list(rng.integers(4, len(_PIECES), size=n)) for n in (7, 3, 10, 1)]
  to_ctranslate2.convert(params, config, _PIECES, str(tmp_path / 'ct2'))
  translator = ctranslate2.Translator(str(tmp_path / 'ct2'), device='cpu')
  scored = translator.score_batch(
      [[_PIECES[i] for i in s] for s in src],
      [[_PIECES[i] for i in t] for t in tgt])
  for ours, theirs in zip(_log_probs(params, config, src, tgt), scored):
    np.testing.assert_allclose(theirs.log_probs, ours, atol=1e-5, rtol=0)


def test_a_vocabulary_that_does_not_fit_the_model_is_refused(tmp_path):
  config = _config()
  params = init_params(config, jax.random.key(0))
  with pytest.raises(to_ctranslate2.ConversionError) as refused:
    to_ctranslate2.convert(params, config, _PIECES[:-1], str(tmp_path / 'o'))
  assert str(refused.value) == (
      f'the model has {len(_PIECES)} source ids but its vocabulary '
      f'{len(_PIECES) - 1} pieces: CTranslate2 needs one token per id.')
  assert not os.path.exists(tmp_path / 'o')


def _command(*flags):
  return subprocess.run(
      [sys.executable, '-m', 'flaxformer_mini.to_ctranslate2', *flags],
      capture_output=True, text=True, cwd=ROOT, timeout=600)


def _greedy_both(params, config, sources, folder):
  """Each source alone, greedy, at its own output length: (the project's
  tokens, CTranslate2's), as lists of pieces."""
  pieces = _PIECES[:config.tgt_vocab_size]
  to_ctranslate2.convert(params, config, pieces, folder)
  translator = ctranslate2.Translator(folder, device='cpu')
  greedy = jax.jit(decoding.greedy_decode, static_argnums=(2,),
                   static_argnames='max_len')
  ours, theirs = [], []
  for ids in sources:
    max_len = decoding.default_max_len(config, len(ids) + 1)
    row = np.asarray(greedy(params, jnp.asarray([ids + [config.eos_id]]),
                            config, max_len=max_len))[0]
    ours.append([pieces[i] for i in decoding.tokens_before_eos(
        row, config.eos_id, config.pad_id)])
    theirs.append(translator.translate_batch(
        [[pieces[i] for i in ids]], beam_size=1,
        max_decoding_length=max_len)[0].hypotheses[0])
  return ours, theirs


@pytest.mark.slow
@pytest.mark.parametrize('pre_norm', [False, True], ids=['paper', 'pre_norm'])
def test_a_trained_model_decodes_greedily_token_for_token(
    pre_norm, small_copy_config, train_copy_model, tmp_path):
  """The copy model, trained to copy exactly, on 100 sources of every
  length up to its own (the shorter ones it has not learnt: outputs of every
  kind and length): CTranslate2's greedy tokens are the project's."""
  config = small_copy_config.replace(pre_norm=pre_norm)
  state, _, _ = train_copy_model(config)
  rng = np.random.default_rng(2)
  sources = [rng.integers(config.first_ordinary_id, config.src_vocab_size,
                          size=n).tolist()
             for n in rng.integers(1, config.copy_length + 1, 100)]
  ours, theirs = _greedy_both(state.params, config, sources,
                              str(tmp_path / 'ct2'))
  assert ours == theirs
  assert len({' '.join(tokens) for tokens in ours}) > 50
  assert all(tokens == [_PIECES[i] for i in ids]
             for tokens, ids in zip(ours, sources)
             if len(ids) == config.copy_length)


@pytest.mark.slow
def test_the_command_writes_a_model_and_refuses_in_one_line(
    tiny_run, tmp_path):
  workdir, _ = tiny_run
  taken = tmp_path / 'taken'
  taken.mkdir()
  (taken / 'keep.txt').write_text('mine')
  made = _command(f'--workdir={workdir}', f'--out={tmp_path / "ct2"}')
  assert made.returncode == 0, made.stderr
  assert sorted(os.listdir(tmp_path / 'ct2')) == [
      'config.json', 'model.bin', 'shared_vocabulary.json', 'spm.model']
  refused = _command(f'--workdir={workdir}', f'--out={taken}')
  assert refused.returncode == 2
  assert refused.stderr == (
      f'python -m flaxformer_mini.to_ctranslate2: error: --out={taken} '
      'exists; name a new folder (nothing there was changed).\n')
  assert os.listdir(taken) == ['keep.txt']
  empty = tmp_path / 'not_a_run'
  empty.mkdir()
  refused = _command(f'--workdir={empty}', f'--out={tmp_path / "new"}')
  assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1
  assert 'no spm.model there' in refused.stderr
  assert not os.path.exists(tmp_path / 'new')
