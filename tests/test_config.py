import dataclasses
import math

import pytest

from flaxformer_mini import config as config_lib
from flaxformer_mini.tasks import train_copy, train_translation


def test_presets_match_the_paper_and_the_walkthrough():
  toy = config_lib.get_config('toy')
  assert (toy.d_model, toy.num_heads, toy.d_k) == (8, 2, 4)
  assert toy.num_encoder_layers == toy.num_decoder_layers == 2
  base = config_lib.get_config('base')
  assert (base.num_encoder_layers, base.d_model, base.d_ff, base.num_heads,
          base.dropout_rate) == (6, 512, 2048, 8, 0.1)
  big = config_lib.get_config('big')
  assert (big.d_model, big.d_ff, big.num_heads, big.dropout_rate) == (
      1024, 4096, 16, 0.3)
  assert not base.pre_norm  # post-norm, as in the paper, by default


def test_config_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    config_lib.get_config('toy').d_model = 4


@pytest.mark.parametrize('changes, message', [
    ({'num_heads': 3}, r'^num_heads=3: must divide d_model=8'),
    ({'dropout_rate': 1.0}, r'^dropout_rate=1.0: must lie in \[0, 1\)'),
    ({'relu_dropout_rate': -0.1}, r'^relu_dropout_rate=-0.1'),
    ({'d_ff': 0}, r'^d_ff=0: must be a positive integer'),
    ({'seed': -1}, r'^seed=-1: must be >= 0'),
    ({'lr_factor': math.nan}, r'^lr_factor=nan: must be a positive finite'),
    ({'lr_factor': math.inf}, r'^lr_factor=inf'),
    ({'layer_norm_epsilon': 0.0}, r'^layer_norm_epsilon=0.0'),
    ({'eval_alpha': math.nan}, r'^eval_alpha=nan: must be a finite number'),
    ({'max_train_minutes': math.inf}, r'^max_train_minutes=inf'),
    ({'dtype': 'float16'}, r'^dtype=float16: allowed values: float32, '
     'bfloat16'),
    ({'eval_stopping': 'early'}, r'^eval_stopping=early: allowed values: '
     r'exact, beam_finished, current_length\.$'),
    ({'tgt_vocab_size': 12}, r'^share_embeddings=True: needs one shared'),
    ({'average_last': -1}, r'^average_last=-1'),
    ({'cooldown_steps': -1}, r'^cooldown_steps=-1: must be >= 0'),
    ({'cooldown_steps': 3001}, r'^cooldown_steps=3001: must not exceed '
     'train_steps=3000'),
])
def test_bad_values_name_the_field(changes, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.get_config('toy').replace(**changes)


def test_task_fields_are_checked_by_their_task_only():
  # A model with max_len 8 and one language is a model; only the copy task
  # needs room for copy_length + 2, and only translation two languages.
  short = config_lib.TransformerConfig(max_len=8, tgt_lang='de')
  with pytest.raises(config_lib.ConfigError, match=r'^copy_length=10'):
    train_copy.check_config(short)
  with pytest.raises(config_lib.ConfigError, match=r'^src_lang=de: the same'):
    train_translation.check_config(short)
  with pytest.raises(config_lib.ConfigError, match=r'^src_vocab_size=3:'):
    train_copy.check_config(config_lib.get_config('copy').replace(
        src_vocab_size=3, tgt_vocab_size=3, label_smoothing=0.0))
  with pytest.raises(config_lib.ConfigError,
                     match=r'^tokens_per_batch=100: holds no batch'):
    train_translation.check_config(config_lib.get_config('translate').replace(
        tokens_per_batch=100))
  with pytest.raises(config_lib.ConfigError, match=(
      r'^tokens_per_batch=1000: holds no batch of 8 row\(s\) \(one per device '
      r'and micro-batch\) of length max_len=128; raise it to at least 1024, '
      r'or lower max_len or grad_accumulation.$')):
    train_translation.check_config(config_lib.get_config('translate').replace(
        tokens_per_batch=1000, grad_accumulation=8))
  with pytest.raises(config_lib.ConfigError, match=(
      r'^batch_size=64 does not divide over 1 devices x 3 micro-batches '
      r'\(grad_accumulation\); use a multiple of 3, e.g. 63.$')):
    train_copy.check_config(config_lib.get_config('copy').replace(
        batch_size=64, grad_accumulation=3))
  # One value suggested, never 'e.g. 256 or 256'.
  with pytest.raises(config_lib.ConfigError,
                     match=r'use a multiple of 256, e.g. 256.$'):
    train_copy.check_config(config_lib.get_config('copy').replace(
        batch_size=100, grad_accumulation=256))
  with pytest.raises(config_lib.ConfigError,
                     match=r'^average_last=9: the run keeps only'):
    train_translation.check_config(config_lib.get_config('translate').replace(
        average_last=9))


def test_heads_error_lists_the_allowed_values():
  with pytest.raises(config_lib.ConfigError, match=r'\[1, 2, 4, 8\]'):
    config_lib.get_config('toy').replace(num_heads=3)


def test_unknown_preset():
  with pytest.raises(config_lib.ConfigError, match='toy, copy'):
    config_lib.get_config('huge')


def test_a_run_saved_before_the_stopping_rule_was_a_setting_keeps_exact():
  """Its translations were made with the exact bound: they stay as they
  were, whatever the default of a new config."""
  from flaxformer_mini import checkpoints  # pylint: disable=g-import-not-at-top
  fields = dataclasses.asdict(config_lib.get_config('toy'))
  del fields['eval_stopping']
  assert checkpoints.saved_config({'config': fields}).eval_stopping == 'exact'
  fields['eval_stopping'] = 'current_length'
  assert checkpoints.saved_config({'config': fields}).eval_stopping == (
      'current_length')
