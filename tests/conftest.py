"""Shared fixtures: the walkthrough's toy model and a batch of two pairs."""

import jax
import jax.numpy as jnp
import pytest

from flaxformer_mini.config import get_config
from flaxformer_mini.masks import make_batch
from flaxformer_mini.training import init_params


@pytest.fixture(scope='session')
def toy_config():
  return get_config('toy')


@pytest.fixture(scope='session')
def toy_batch(toy_config):
  """Batch 2, source length 3, target length 2 (tgt_in/tgt_out), one pad each."""
  cfg = toy_config
  src = jnp.array([[5, 6, 7], [8, 9, cfg.pad_id]])
  tgt = jnp.array([[cfg.bos_id, 5, 6], [cfg.bos_id, 8, cfg.eos_id]])
  return make_batch(src, tgt, cfg)


@pytest.fixture(scope='session')
def toy_params(toy_config):
  return init_params(toy_config, jax.random.key(0))
