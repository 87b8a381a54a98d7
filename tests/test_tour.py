"""The tensor tour: the walkthrough's shapes, the concatenation identity, masks."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_mini import tour
from flaxformer_mini.config import get_config
from flaxformer_mini.model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def stops(toy_config, toy_params):
  return {s.name: s for s in tour.tensor_tour(
      toy_config, toy_params, tour.example_batch(toy_config))}


def test_the_walkthrough_shapes(stops):
  # toy: d_model 8, 2 heads (d_k 4), batch 2, source length 3, target length 2.
  expected = {
      'batch/src': (2, 3),
      'batch/tgt_in': (2, 2),
      'encoder/token_embedding': (2, 3, 8),
      'encoder/positional_encoding/encoding': (2, 3, 8),
      'encoder/layer_0/self_attention/query': (2, 2, 3, 4),
      'encoder/layer_0/self_attention/key': (2, 2, 3, 4),
      'encoder/layer_0/self_attention/value': (2, 2, 3, 4),
      'encoder/layer_0/self_attention/scores': (2, 2, 3, 3),
      'encoder/layer_0/self_attention/concatenated': (2, 3, 8),
      'decoder/layer_0/self_attention/weights': (2, 2, 2, 2),
      'decoder/layer_1/cross_attention/query': (2, 2, 2, 4),
      'decoder/layer_1/cross_attention/key': (2, 2, 3, 4),
      'decoder/layer_1/cross_attention/weights': (2, 2, 2, 3),
      'decoder/layer_1/feed_forward/hidden': (2, 2, 16),
      'decoder/layer_1/feed_forward/output': (2, 2, 8),
      'decoder/layer_1/after_feed_forward': (2, 2, 8),
      'logits': (2, 2, 11),
  }
  for name, shape in expected.items():
    assert stops[name].shape == shape, name


def test_every_stop_names_one_axis_per_dimension(stops):
  for stop in stops.values():
    axes = stop.axes.strip('[]').split(', ')
    assert len(axes) == stop.value.ndim, (stop.name, stop.axes, stop.shape)


def test_the_tour_runs_in_forward_order(toy_config, toy_params):
  names = [s.name for s in tour.tensor_tour(
      toy_config, toy_params, tour.example_batch(toy_config))]
  order = ['batch/src', 'encoder/token_embedding', 'encoder/embedded',
           'encoder/layer_0/self_attention/query',
           'encoder/layer_0/self_attention/weights',
           'encoder/layer_0/after_self_attention',
           'encoder/layer_0/feed_forward/hidden',
           'encoder/layer_0/feed_forward/output',
           'encoder/layer_0/after_feed_forward', 'encoder/layer_1/after_feed_forward',
           'decoder/embedded', 'decoder/layer_0/self_attention/output',
           'decoder/layer_0/after_self_attention',
           'decoder/layer_0/cross_attention/query',
           'decoder/layer_0/after_cross_attention',
           'decoder/layer_1/after_feed_forward', 'logits']
  assert [names.index(n) for n in order] == sorted(
      names.index(n) for n in order)
  assert len(names) == len(set(names))


def test_concatenation_puts_head_h_in_slice_h(stops):
  """The first d_k numbers of position 0 are exactly head 0's output there."""
  for block in ('encoder/layer_0/self_attention',
                'decoder/layer_1/cross_attention'):
    heads = stops[f'{block}/heads'].value          # [batch, heads, len, d_k]
    concatenated = stops[f'{block}/concatenated'].value  # [batch, len, d_model]
    np.testing.assert_array_equal(concatenated[0, 0, :4], heads[0, 0, 0])
    np.testing.assert_array_equal(concatenated[0, 0, 4:], heads[0, 1, 0])
    np.testing.assert_array_equal(
        concatenated, heads.transpose(0, 2, 1, 3).reshape(concatenated.shape))


def test_output_projection_and_attention_arithmetic(stops, toy_params):
  block = 'encoder/layer_0/self_attention'
  query, key, value = (stops[f'{block}/{n}'].value for n in
                       ('query', 'key', 'value'))
  scores = stops[f'{block}/scores'].value
  np.testing.assert_allclose(scores[0], query[0] @ key[0].transpose(0, 2, 1) /
                             2.0, rtol=1e-5, atol=1e-6)  # sqrt(d_k) = 2
  weights = stops[f'{block}/weights'].value
  np.testing.assert_allclose(stops[f'{block}/heads'].value[0],
                             weights[0] @ value[0], rtol=1e-5, atol=1e-6)
  wo = toy_params['encoder']['layer_0']['self_attention']['wo']
  np.testing.assert_allclose(
      stops[f'{block}/output'].value,
      stops[f'{block}/concatenated'].value @ np.asarray(wo['kernel']) +
      np.asarray(wo['bias']), rtol=1e-5, atol=1e-6)


def test_embeddings_plus_positions_and_masked_weights(stops):
  for side in ('encoder', 'decoder'):
    np.testing.assert_allclose(
        stops[f'{side}/embedded'].value,
        stops[f'{side}/token_embedding'].value +
        stops[f'{side}/positional_encoding/encoding'].value, rtol=1e-5,
        atol=1e-6)
  # Item 1's source ends in a pad: no query may look at it.
  for name in ('encoder/layer_0/self_attention/weights',
               'decoder/layer_0/cross_attention/weights'):
    assert np.all(stops[name].value[1, :, :, 2] == 0)
  # Decoder self-attention: position 0 never sees position 1.
  assert np.all(stops['decoder/layer_1/self_attention/weights'].value[
      :, :, 0, 1] == 0)


def test_tour_logits_are_the_models(stops, toy_config, toy_params):
  batch = tour.example_batch(toy_config)
  logits = Transformer(toy_config).apply(
      {'params': toy_params}, batch.src, batch.tgt_in, batch.src_mask,
      batch.tgt_mask)
  np.testing.assert_allclose(stops['logits'].value, np.asarray(logits),
                             rtol=1e-5, atol=1e-6)  # jit vs eager rounding
  assert jnp.all(stops['batch/tgt_out'].value == batch.tgt_out)


@pytest.mark.slow
def test_the_tour_command_prints_the_table():
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'train.py'), '--task=copy',
       '--config=toy', '--tour'], capture_output=True, text=True, cwd=ROOT,
      timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  row = next(l for l in lines
             if l.startswith('decoder/layer_0/cross_attention/weights '))
  assert '(2, 2, 2, 3)' in row and '[batch, heads, tgt_len, src_len]' in row
  assert lines[-1].startswith('logits') and '(2, 2, 11)' in lines[-1]


def test_a_shapes_only_tour_of_the_base_model():
  base = get_config('base')
  stops = tour.tensor_tour(base, None, tour.example_batch(base))
  shapes = {s.name: s.shape for s in stops}
  assert shapes['encoder/layer_5/self_attention/query'] == (2, 8, 3, 64)
  assert shapes['decoder/layer_5/cross_attention/weights'] == (2, 8, 2, 3)
  assert shapes['logits'] == (2, 2, base.tgt_vocab_size)
  # Every sublayer keeps [batch, len, d_model]: the stacks can be any depth.
  for name, shape in shapes.items():
    if '/after_' in name:
      assert shape[-1] == base.d_model and shape == shapes[
          name.split('/')[0] + '/embedded']
