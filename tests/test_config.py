import dataclasses

import pytest

from flaxformer_mini import config as config_lib


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


def test_override_parses_strings_by_field_type():
  cfg = config_lib.override(config_lib.get_config('copy'), {
      'd_model': '32', 'pre_norm': 'true', 'dropout_rate': '0.2'})
  assert (cfg.d_model, cfg.pre_norm, cfg.dropout_rate) == (32, True, 0.2)


@pytest.mark.parametrize('overrides, names', [
    ({'num_heads': '3'}, '--num_heads'),
    ({'dropout_rate': '1.0'}, '--dropout_rate'),
    ({'dropout_rate': '-0.1'}, '--dropout_rate'),
    ({'d_ff': '0'}, '--d_ff'),
    ({'num_decoder_layers': '-1'}, '--num_decoder_layers'),
    ({'nonsense': '1'}, '--nonsense'),
    ({'pre_norm': 'maybe'}, '--pre_norm'),
    ({'d_model': 'wide'}, '--d_model'),
    ({'tgt_vocab_size': '12'}, '--share_embeddings'),
    ({'attention_implementation': 'flash'}, 'explicit, xla, cudnn'),
    ({'attention_implementation': 'cudnn'}, '--dtype=bfloat16'),
    ({'attention_implementation': 'xla', 'attention_dropout_rate': '0.1'},
     '--attention_dropout_rate=0'),
])
def test_bad_values_name_the_field(overrides, names):
  with pytest.raises(config_lib.ConfigError, match=names):
    config_lib.override(config_lib.get_config('copy'), overrides)


def test_heads_error_lists_the_allowed_values():
  with pytest.raises(config_lib.ConfigError, match=r'\[1, 2, 4, 8\]'):
    config_lib.get_config('toy').replace(num_heads=3)


def test_unknown_preset():
  with pytest.raises(config_lib.ConfigError, match='toy, copy'):
    config_lib.get_config('huge')
