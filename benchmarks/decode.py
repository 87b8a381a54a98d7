"""Decoding throughput: greedy and beam search over the cached decoder.

  python benchmarks/decode.py --config small --beam 1 4

Random weights, batch 32, source length 32, exactly --gen_len generated tokens
per sentence: eos is made impossible (its logit is -inf) so that every run does
the same work. Compile time is reported apart from the steady state. Prints one
JSON object.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini import decoding
from flaxformer_mini.config import get_config
from flaxformer_mini.masks import padding_mask
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import init_params

import common


def decode_without_eos(params, src, config, beam_size: int, gen_len: int):
  """Greedy (beam_size 1) or beam search that can never stop before gen_len.

  Built from the library's model-agnostic pieces, with the one change of
  forbidding eos. -> int32[batch, gen_len].
  """
  src_mask = padding_mask(src, config.pad_id)
  encoded = Transformer(config).apply({'params': params}, src, src_mask,
                                      method=Transformer.encode)
  cache = decoding.init_cache(config, encoded, src_mask, gen_len)
  step = decoding.transformer_tokens_to_logits(
      params, config, decoding.expand_to_beams(encoded, beam_size),
      decoding.expand_to_beams(src_mask, beam_size))

  def no_eos(tokens, cache):
    logits, cache = step(tokens, cache)
    return logits.at[:, config.eos_id].set(-jnp.inf), cache

  ids = dict(bos_id=config.bos_id, eos_id=config.eos_id, pad_id=config.pad_id)
  if beam_size == 1:
    return decoding.greedy_search(no_eos, cache, src.shape[0], gen_len, **ids)
  return decoding.beam_search(
      no_eos, cache, batch_size=src.shape[0], beam_size=beam_size,
      max_len=gen_len, alpha=0.6, **ids).sequences[:, 0]


def measure(config, params, src, beam_size: int, gen_len: int, repeats: int):
  fn = jax.jit(functools.partial(decode_without_eos, config=config,
                                 beam_size=beam_size, gen_len=gen_len))
  start = time.perf_counter()
  compiled = fn.lower(params, src).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  out = jax.block_until_ready(compiled(params, src))
  first_run_s = time.perf_counter() - start
  assert out.shape == (src.shape[0], gen_len)
  assert not np.any(np.asarray(out) == config.eos_id)
  seconds = common.median_seconds(
      lambda: jax.block_until_ready(compiled(params, src)), repeats)
  batch = src.shape[0]
  return {
      'beam': beam_size,
      'compile_s': compile_s,
      'first_call_s': compile_s + first_run_s,
      'decode_s': seconds,
      'step_s': seconds / gen_len,
      'sentences_per_s': batch / seconds,
      'generated_tokens_per_s': batch * gen_len / seconds,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='small', choices=['small', 'base'])
  parser.add_argument('--beam', type=int, nargs='+', default=[1, 4])
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--src_len', type=int, default=32)
  parser.add_argument('--gen_len', type=int, default=32)
  parser.add_argument('--repeats', type=int, default=5)
  args = parser.parse_args()
  config = get_config(args.config).replace(dropout_rate=0.0)
  params = init_params(config, jax.random.key(0))
  src = jnp.asarray(np.random.default_rng(0).integers(
      3, config.src_vocab_size, (args.batch, args.src_len)), jnp.int32)
  runs = [measure(config, params, src, beam, args.gen_len, args.repeats)
          for beam in args.beam]
  common.emit({'benchmark': 'decode', 'config': args.config,
               'batch': args.batch, 'src_len': args.src_len,
               'gen_len': args.gen_len, 'runs': runs})


if __name__ == '__main__':
  main()
