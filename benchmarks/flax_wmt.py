"""The Flax WMT example's model and beam search, as the benchmarks' baseline.

Its code is not part of this project: `load()` fetches the source
distribution of the installed flax version from the package index once
(`pip download --no-binary :all: flax==<version>`, which carries
examples/wmt), keeps examples/wmt/models.py and decode.py in
~/.cache/flaxformer_mini/flax_wmt/<version>/ and imports them from there.

The baseline gets exactly the work ours gets: the same sizes, dropout and
attention dropout, the same optax optimizer and the same label-smoothed loss
on its logits (so the comparison is of the models and their steps, not of the
loss formulation), the same batches, and eos made impossible in decoding.
"""

import functools
import glob
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile

import flax
import jax
import jax.numpy as jnp
from flax.training import train_state

from flaxformer_mini import losses
from flaxformer_mini.schedules import make_optimizer

CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'flaxformer_mini',
                     'flax_wmt', flax.__version__)
FILES = ('models.py', 'decode.py')


def load():
  """(models, decode): the example's modules for the installed flax."""
  if not all(os.path.isfile(os.path.join(CACHE, f)) for f in FILES):
    os.makedirs(CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
      fetched = subprocess.run(
          [sys.executable, '-m', 'pip', 'download', '-q', '--no-deps',
           '--no-binary', ':all:', '-d', download,
           f'flax=={flax.__version__}'])
      if fetched.returncode:
        raise RuntimeError(
            f'cannot fetch the flax {flax.__version__} source distribution '
            f'for the Flax WMT example (pip said why, above); offline, put '
            f'its examples/wmt/{{models,decode}}.py in {CACHE}, or run with '
            '--no_baseline.')
      (archive,) = glob.glob(os.path.join(download, 'flax-*.tar.gz'))
      with tarfile.open(archive) as tar:
        for name in FILES:
          member = tar.getmember(
              f'flax-{flax.__version__}/examples/wmt/{name}')
          with open(os.path.join(CACHE, name), 'wb') as f:
            f.write(tar.extractfile(member).read())
  modules = []
  for name in FILES:
    spec = importlib.util.spec_from_file_location(
        f'flax_wmt_{name[:-3]}', os.path.join(CACHE, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    modules.append(module)
  return tuple(modules)


def wmt_config(models, config, decode: bool = False):
  """Our TransformerConfig in the example's terms (shared, tied embeddings)."""
  return models.TransformerConfig(
      vocab_size=config.src_vocab_size,
      output_vocab_size=config.tgt_vocab_size,
      share_embeddings=config.share_embeddings,
      logits_via_embedding=config.tie_output_embedding,
      dtype=jnp.dtype(config.dtype),
      emb_dim=config.d_model, num_heads=config.num_heads,
      num_layers=config.num_encoder_layers, qkv_dim=config.d_model,
      mlp_dim=config.d_ff, max_len=config.max_len,
      dropout_rate=config.dropout_rate,
      attention_dropout_rate=config.attention_dropout_rate,
      deterministic=decode, decode=decode)


def create_state(models, config, rng) -> train_state.TrainState:
  model = models.Transformer(wmt_config(models, config))
  ids = jnp.ones((1, 8), jnp.int32)
  params = model.init(rng, ids, ids)['params']
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=make_optimizer(config))


def train_step(state, batch, rng, config):
  """One update of the example's model: our loss and optimizer, its model.

  Its decoder shifts the targets right itself, so it reads tgt_out.
  """
  step_rng = jax.random.fold_in(rng, state.step)

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, batch.src, batch.tgt_out,
                            rngs={'dropout': step_rng})
    loss_sum, ntokens = losses.label_smoothed_kl(
        logits, batch.tgt_out, config.label_smoothing, config.pad_id)
    return loss_sum / ntokens

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def decode_without_eos(params, src, config, beam_size: int, gen_len: int):
  """The example's beam_search (or a cached greedy loop over its model).

  eos is made impossible, as in benchmarks/decode.py. -> int32[batch, gen_len].
  """
  models, decode = load()
  wmt = wmt_config(models, config, decode=True)
  model = models.Transformer(wmt)
  encoded = decode.flat_batch_beam_expand(
      model.apply({'params': params}, src, method=models.Transformer.encode),
      beam_size)
  raw_inputs = decode.flat_batch_beam_expand(src, beam_size)
  # Its sequences start with a dummy 0: gen_len tokens need gen_len + 1.
  cache = model.init(jax.random.key(0), jnp.ones(src.shape, jnp.int32),
                     jnp.ones((src.shape[0], gen_len + 1), jnp.int32))['cache']

  def tokens_to_logits(ids, cache):
    logits, variables = model.apply(
        {'params': params, 'cache': cache}, encoded, raw_inputs, ids,
        mutable=['cache'], method=models.Transformer.decode)
    return logits[:, 0].at[:, config.eos_id].set(-jnp.inf), variables['cache']

  if beam_size > 1:
    sequences, _ = decode.beam_search(
        src, cache, tokens_to_logits, beam_size=beam_size, alpha=0.6,
        eos_id=config.eos_id, max_decode_len=gen_len + 1)
    return sequences[:, -1, 1:]  # beams are sorted worst to best

  def one_token(step, carry):
    tokens, cache = carry
    last = jax.lax.dynamic_slice_in_dim(tokens, step, 1, axis=1)
    logits, cache = tokens_to_logits(last, cache)
    tokens = jax.lax.dynamic_update_slice_in_dim(
        tokens, jnp.argmax(logits, -1)[:, None].astype(jnp.int32), step + 1,
        axis=1)
    return tokens, cache

  tokens = jnp.zeros((src.shape[0], gen_len + 1), jnp.int32)  # 0 starts
  tokens, _ = jax.lax.fori_loop(0, gen_len, one_token, (tokens, cache))
  return tokens[:, 1:]


def jitted_train_step(config):
  return jax.jit(functools.partial(train_step, config=config),
                 donate_argnums=0)
