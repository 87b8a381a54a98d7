import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_mini.masks import make_batch
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import init_params


def _forward(cfg, params, batch, **kwargs):
  return Transformer(cfg).apply({'params': params}, batch.src, batch.tgt_in,
                                batch.src_mask, batch.tgt_mask, **kwargs)


def test_toy_model_reproduces_the_walkthrough_shapes(toy_config, toy_params,
                                                     toy_batch):
  logits, state = _forward(toy_config, toy_params, toy_batch,
                           mutable=['intermediates'])
  inter = state['intermediates']
  assert logits.shape == (2, 2, toy_config.tgt_vocab_size)
  assert logits.dtype == jnp.float32
  for i in range(2):
    enc = inter['encoder'][f'layer_{i}']
    for name in ('query', 'key', 'value'):
      assert enc['self_attention'][name][0].shape == (2, 2, 3, 4)
    assert enc['self_attention']['weights'][0].shape == (2, 2, 3, 3)
    assert enc['after_self_attention'][0].shape == (2, 3, 8)
    assert enc['after_feed_forward'][0].shape == (2, 3, 8)
    dec = inter['decoder'][f'layer_{i}']
    for name in ('query', 'key', 'value'):
      assert dec['self_attention'][name][0].shape == (2, 2, 2, 4)
    assert dec['self_attention']['weights'][0].shape == (2, 2, 2, 2)
    # Second block: queries from the decoder, keys and values from the encoder.
    assert dec['cross_attention']['query'][0].shape == (2, 2, 2, 4)
    assert dec['cross_attention']['key'][0].shape == (2, 2, 3, 4)
    assert dec['cross_attention']['value'][0].shape == (2, 2, 3, 4)
    assert dec['cross_attention']['weights'][0].shape == (2, 2, 2, 3)
    for name in ('after_self_attention', 'after_cross_attention',
                 'after_feed_forward'):
      assert dec[name][0].shape == (2, 2, 8)


@pytest.fixture(scope='module')
def leak_setup(toy_config):
  cfg = toy_config.replace(d_model=16, num_heads=4, d_ff=32)
  params = init_params(cfg, jax.random.key(3))
  rng = np.random.default_rng(0)
  src = rng.integers(3, cfg.src_vocab_size, size=(2, 7))
  src[1, 4:] = cfg.pad_id
  tgt = rng.integers(3, cfg.tgt_vocab_size, size=(2, 7))
  tgt[:, 0] = cfg.bos_id
  return cfg, params, make_batch(src, tgt, cfg)


# That no future target token and no source pad reaches a logit is proven
# for every switch of the config in test_switches.py.


def test_weight_tying_switches(toy_config):
  tied = init_params(toy_config, jax.random.key(0))
  assert 'shared_embedding' in tied and 'output_projection' not in tied
  untied_cfg = toy_config.replace(share_embeddings=False,
                                  tie_output_embedding=False,
                                  tgt_vocab_size=13)
  untied = init_params(untied_cfg, jax.random.key(0))
  assert {'source_embedding', 'target_embedding', 'output_projection'} <= set(
      untied)
  assert untied['output_projection']['kernel'].shape == (8, 13)


def test_pre_norm_adds_a_final_norm_to_each_stack(toy_config):
  params = init_params(toy_config.replace(pre_norm=True), jax.random.key(0))
  assert 'final_norm' in params['encoder'] and 'final_norm' in params['decoder']
  assert 'final_norm' not in init_params(toy_config, jax.random.key(0))[
      'encoder']


def test_dropout_is_active_only_when_not_deterministic(leak_setup):
  cfg, _, batch = leak_setup
  cfg = cfg.replace(dropout_rate=0.5)
  params = init_params(cfg, jax.random.key(0))
  a = _forward(cfg, params, batch)
  b = _forward(cfg, params, batch, deterministic=False,
               rngs={'dropout': jax.random.key(1)})
  np.testing.assert_array_equal(a, _forward(cfg, params, batch))
  assert not np.allclose(a, b)
