"""Decoding throughput: greedy and beam search over the cached decoder.

  python benchmarks/decode.py --config small --beam 1 4

Random weights, batch 32, source length 32, exactly --gen_len generated tokens
per sentence: eos is made impossible (its logit is -inf) so that every run does
the same work. Compile time is reported apart from the steady state. Prints one
JSON object.

The Flax WMT example (benchmarks/flax_wmt.py) decodes the same sources with
its own model and beam_search (beam > 1) or a cached greedy loop over its
model (beam 1), in the same process, its searches and ours timed in turns;
`speedup` is its median time over ours, with a 90 % bootstrap interval
(common.speedup). --no_baseline skips it.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_mini import decoding, search
from flaxformer_mini.config import get_config
from flaxformer_mini.masks import padding_mask
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import init_params

import common
import flax_wmt


def decode_without_eos(params, src, config, beam_size: int, gen_len: int,
                       cross_kv_once: bool = True):
  """Greedy (beam_size 1) or beam search that can never stop before gen_len.

  Built from the library's public pieces, as beam_decode builds it, with the
  one change of forbidding eos. cross_kv_once=False projects the encoder
  output through W^K, W^V again at every step (benchmarks/levers.py).
  -> int32[batch, gen_len].
  """
  src_mask = padding_mask(src, config.pad_id)
  encoded = Transformer(config).apply({'params': params}, src, src_mask,
                                      method=Transformer.encode)
  cache = decoding.init_cache(config, src.shape[0], gen_len)
  # One row of encoder output per sentence: its beams' queries read it
  # together (attention.grouped_attention).
  if cross_kv_once:
    step = decoding.transformer_tokens_to_logits(params, config, encoded,
                                                 src_mask)
  else:
    model = Transformer(config)

    def step(tokens, cache):
      logits, variables = model.apply(
          {'params': params, 'cache': cache}, encoded, src_mask, tokens,
          incremental=True, mutable=['cache'], method=Transformer.decode)
      return logits[:, -1], variables['cache']

  def no_eos(tokens, cache):
    logits, cache = step(tokens, cache)
    return logits.at[:, config.eos_id].set(-jnp.inf), cache

  ids = dict(bos_id=config.bos_id, eos_id=config.eos_id, pad_id=config.pad_id)
  if beam_size == 1:
    return search.greedy_search(no_eos, cache, batch_size=src.shape[0],
                               max_len=gen_len, **ids)
  return search.beam_search(
      no_eos, cache, batch_size=src.shape[0], beam_size=beam_size,
      max_len=gen_len, alpha=0.6, **ids).sequences[:, 0]


def random_model_and_sources(config, batch: int = 32, src_len: int = 32):
  """Random weights and source ids -> (params, int32[batch, src_len])."""
  params = init_params(config, jax.random.key(0))
  src = jnp.asarray(np.random.default_rng(0).integers(
      3, config.src_vocab_size, (batch, src_len)), jnp.int32)
  return params, src


def flax_wmt_params(config):
  """The Flax WMT example's model at config's sizes, random weights -> params."""
  models, _ = flax_wmt.load()
  return flax_wmt.create_state(models, config, jax.random.key(0)).params


def _compiled(fn, params, src, gen_len: int, eos_id: int):
  """fn compiled ahead of time and called once (checked) -> (call, figures)."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(params, src).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  out = jax.block_until_ready(compiled(params, src))
  first_run_s = time.perf_counter() - start
  assert out.shape == (src.shape[0], gen_len), out.shape
  assert not np.any(np.asarray(out) == eos_id)
  return (lambda: jax.block_until_ready(compiled(params, src)),
          {'compile_s': compile_s, 'first_call_s': compile_s + first_run_s})


def _throughput(times: list[float], batch: int, gen_len: int) -> dict:
  seconds = float(np.median(times))
  return {'decode_s': seconds, 'step_s': seconds / gen_len,
          'sentences_per_s': batch / seconds,
          'generated_tokens_per_s': batch * gen_len / seconds}


def measure(config, params, baseline_params, src, beam_size: int,
            gen_len: int, repeats: int):
  """Ours and the Flax WMT example's search, timed in turns (medians)."""
  calls, result = {}, {'beam': beam_size}
  calls['ours'], compiled = _compiled(
      functools.partial(decode_without_eos, config=config,
                        beam_size=beam_size, gen_len=gen_len),
      params, src, gen_len, config.eos_id)
  result.update(compiled)
  if baseline_params is not None:
    calls['flax_wmt'], result['flax_wmt'] = _compiled(
        functools.partial(flax_wmt.decode_without_eos, config=config,
                          beam_size=beam_size, gen_len=gen_len),
        baseline_params, src, gen_len, config.eos_id)
  times = common.interleaved_seconds(calls, repeats)
  batch = src.shape[0]
  result.update(_throughput(times['ours'], batch, gen_len))
  if baseline_params is not None:
    result['flax_wmt'].update(_throughput(times['flax_wmt'], batch, gen_len))
    result.update(common.speedup(times['flax_wmt'], times['ours']))
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='small', choices=['small', 'base'])
  parser.add_argument('--beam', type=int, nargs='+', default=[1, 4])
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--src_len', type=int, default=32)
  parser.add_argument('--gen_len', type=int, default=32)
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--dtype', default='float32',
                      choices=['float32', 'bfloat16'])
  parser.add_argument('--cpu_kernels', action='store_true',
                      help='ours only: config.cpu_kernels (cpu_kernels.py)')
  parser.add_argument('--no_baseline', action='store_true',
                      help="skip the Flax WMT example's decoding")
  args = parser.parse_args()
  config = get_config(args.config).replace(dropout_rate=0.0, dtype=args.dtype,
                                           cpu_kernels=args.cpu_kernels)
  params, src = random_model_and_sources(config, args.batch, args.src_len)
  baseline_params = None if args.no_baseline else flax_wmt_params(config)
  runs = [measure(config, params, baseline_params, src, beam, args.gen_len,
                  args.repeats) for beam in args.beam]
  common.emit({'benchmark': 'decode', 'config': args.config,
               'dtype': args.dtype, 'cpu_kernels': args.cpu_kernels,
               'batch': args.batch, 'src_len': args.src_len,
               'gen_len': args.gen_len, 'runs': runs})


if __name__ == '__main__':
  main()
