"""The run's logbook (JSON lines + TensorBoard) and its pictures."""

import glob
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from flaxformer_mini import logbook, plots, tour, workdir
from flaxformer_mini.config import get_config


def _tensorboard_scalars(directory):
  """{tag: [(step, value)]} from the TFRecord event files in directory."""
  scalars = {}
  for path in sorted(glob.glob(f'{directory}/events.out.tfevents.*')):
    data = open(path, 'rb').read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack('<Q', data[offset:offset + 8])
      event = event_pb2.Event.FromString(
          data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4  # length, its crc, the record, its crc
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append(
            (event.step, value.simple_value))
  return scalars


def test_records_reach_jsonl_and_tensorboard(tmp_path):
  log = logbook.Logbook(str(tmp_path))
  for step in (10, 20):
    log.write('train', {'step': step, 'loss': 1.0 / step,
                        'learning_rate': 1e-3})
  log.write('eval', {'step': 20, 'val_bleu': 12.5})
  log.close()
  records = logbook.read_records(str(tmp_path))
  assert [r['step'] for r in records['train']] == [10, 20]
  assert records['eval'] == [{'step': 20, 'val_bleu': 12.5}]
  scalars = _tensorboard_scalars(tmp_path / workdir.TENSORBOARD)
  assert scalars['train/loss'] == [(10, pytest.approx(0.1)),
                                   (20, pytest.approx(0.05))]
  assert scalars['eval/val_bleu'] == [(20, 12.5)]


def test_a_resumed_logbook_drops_the_records_it_will_log_again(tmp_path):
  log = logbook.Logbook(str(tmp_path))
  for step in (10, 20, 30):
    log.write('train', {'step': step, 'loss': 1.0})
  log.close()
  resumed = logbook.Logbook(str(tmp_path), start_step=20)
  resumed.write('train', {'step': 30, 'loss': 0.5})
  resumed.close()
  steps_and_losses = [(r['step'], r['loss']) for r in
                      logbook.read_records(str(tmp_path))['train']]
  assert steps_and_losses == [(10, 1.0), (20, 1.0), (30, 0.5)]


def test_training_curves_png(tmp_path):
  log = logbook.Logbook(str(tmp_path))
  for step in range(50, 501, 50):
    log.write('train', {'step': step, 'loss': 5.0 / step ** 0.5,
                        'learning_rate': 1e-3 * min(step / 200, 1)})
  log.write('eval', {'step': 500, 'val_loss': 0.3, 'val_bleu': 20.0})
  log.close()
  path = plots.training_curves(str(tmp_path), 'test run')
  assert path == str(tmp_path / workdir.CURVES)
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_bleu_over_time_png(tmp_path):
  log = logbook.Logbook(str(tmp_path))
  for step, minutes, bleu in ((100, 2.0, 10.0), (200, 4.5, 20.0)):
    log.write('eval', {'step': step, 'wall_minutes': minutes,
                       'val_bleu': bleu, 'val_bleu_lowercase': bleu + 1})
  log.close()
  path = plots.bleu_over_time(str(tmp_path))
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_training_curves_need_records(tmp_path):
  with pytest.raises(ValueError, match='no logged training steps'):
    plots.training_curves(str(tmp_path))


def test_attention_heatmaps_one_panel_per_layer_and_head():
  weights = np.random.default_rng(0).dirichlet(np.ones(4), size=(2, 3, 5))
  figure = plots.attention_heatmaps(weights, list('abcde'), list('wxyz'))
  assert len(figure.axes) == 2 * 3 + 1  # and one colorbar
  assert figure.axes[0].get_title() == 'layer 0, head 0'
  assert figure.axes[0].get_ylabel() == 'query'
  assert figure.axes[3].get_xlabel() == 'key'
  assert figure.axes[-1].get_ylabel() == 'attention weight'
  with pytest.raises(ValueError, match='labels'):
    plots.attention_heatmaps(weights, list('abc'), list('wxyz'))


def test_a_models_three_kinds_of_attention(toy_config, toy_params):
  figures = plots.model_attention(
      toy_config, toy_params, tour.example_batch(toy_config),
      ['a', 'b', 'c'], ['bos', 'x'], item=1)
  assert list(figures) == ['encoder self_attention', 'decoder self_attention',
                           'decoder cross_attention']
  for figure in figures.values():
    assert len(figure.axes) == 2 * 2 + 1  # toy: 2 layers x 2 heads, colorbar
  cross = figures['decoder cross_attention'].axes[0]
  assert cross.get_ylabel() == 'decoder input (query)'
  assert figures['decoder cross_attention'].axes[2].get_xlabel() == (
      'source position (key)')
  assert [t.get_text() for t in cross.get_xticklabels()] == ['a', 'b', 'c']
  assert [t.get_text() for t in cross.get_yticklabels()] == ['bos', 'x']


def test_figure_one_labels_every_arrow_with_the_live_tensor():
  config = get_config('toy')
  stops = tour.tensor_tour(config, None, tour.example_batch(config))
  figure = plots.figure_one(stops, config)
  texts = '\n'.join(t.get_text() for t in figure.axes[0].texts)
  shapes = {s.name: list(s.shape) for s in stops}
  for name in ('batch/src', 'batch/tgt_in', 'encoder/embedded', 'decoder/embedded',
               'encoder/layer_0/self_attention/query',
               'decoder/layer_0/cross_attention/key', 'logits'):
    assert f'{name.split("/")[-1]} {shapes[name]}' in texts, name
  assert f'{config.num_encoder_layers}x' in texts
  # Each Add & Norm's residual arrow carries its sublayer's input.
  for name in ('encoder/embedded', 'decoder/layer_0/after_self_attention',
               'decoder/layer_0/after_cross_attention'):
    assert f'residual\n{name.split("/")[-1]} {shapes[name]}' in texts, name


def test_figure_one_draws_a_model_without_some_stops():
  """A variant without a stop (say, no positional encoding) is drawn with
  that stop labelled as missing, not a KeyError."""
  config = get_config('toy')
  stops = [s for s in tour.tensor_tour(config, None, tour.example_batch(config))
           if 'positional_encoding' not in s.name and
           s.name != 'decoder/layer_0/cross_attention/key']
  texts = '\n'.join(t.get_text() for t in
                    plots.figure_one(stops, config).axes[0].texts)
  assert 'Positional Encoding' not in texts
  assert 'key (not in this model)' in texts
