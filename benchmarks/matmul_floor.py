"""How much of a step is matmuls: the training step's or a search's floor.

  python benchmarks/matmul_floor.py --config small
  python benchmarks/matmul_floor.py --config base --beam 4

Every dot_general of the real program (read from its jaxpr) is timed alone at
its own shapes and dimension numbers (best of --repeats), and the times are
summed with their multiplicities. Against the whole program's time this says
how much of it the matmuls are, and so how much any lever outside them can
buy: a program can get no faster than its matmuls, and a lever that does not
change them can at most remove the rest. float32.

Without --beam: the training step (forward and backward) on fixed synthetic
batches of the issue's shapes (train_step.py's). With --beam 1 or 4:
decode.py's search (batch 32, source length 32, 32 generated tokens; the
decoder's products counted once per generated token), timed in turns with the
Flax WMT example's. A decoding product is a few microseconds of work, so each
is timed in a compiled loop, less the loop's own cost. The example's search
over this floor is the most any search doing these products could gain over
it (`ceiling_speedup`): the products run alone with warm caches, so the
floor is below what they cost inside a real step.
"""

import argparse
import collections
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jax_core

from flaxformer_mini.config import get_config
from flaxformer_mini.training import create_train_state, train_step

import common
import decode as decode_bench
import train_step as train_bench


def _this_platforms_branch(eqn) -> int:
  """The branch of a lax.platform_dependent cond that this backend runs."""
  backend = jax.default_backend()
  names = ('cuda', 'rocm') if backend == 'gpu' else (backend,)
  platforms = eqn.params['branches_platforms']
  for index, branch_platforms in enumerate(platforms):
    if branch_platforms is not None and set(names) & set(branch_platforms):
      return index
  return platforms.index(None)


def dot_generals(jaxpr, loop_trips: int = 1) -> collections.Counter:
  """(lhs shape, rhs shape, dimension numbers) -> count, sub-jaxprs included.

  Of a lax.platform_dependent choice, only the branch of this backend counts.
  The products in a while loop's body count loop_trips times each (a search
  that cannot stop early runs its loop a known number of times).
  """
  found = collections.Counter()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      lhs, rhs = (v.aval for v in eqn.invars)
      found[(lhs.shape, rhs.shape, eqn.params['dimension_numbers'])] += 1
    if eqn.params.get('branches_platforms'):
      found.update(dot_generals(
          eqn.params['branches'][_this_platforms_branch(eqn)].jaxpr,
          loop_trips))
      continue
    trips = loop_trips if eqn.primitive.name == 'while' else 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax_core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax_core.Jaxpr):
          for key, count in dot_generals(sub, loop_trips).items():
            found[key] += count * trips
  return found


def _seconds_alone(product, a, b, repeats: int) -> float:
  """One call of the jitted product: for products of milliseconds."""
  return common.best_seconds(lambda: product(a, b).block_until_ready(),
                             repeats)


# Products timed in a loop run this many times per call.
_LOOP_TRIPS = 64


def _seconds_in_loop(product, a, b, repeats: int) -> float:
  """The product run _LOOP_TRIPS times in one compiled loop, less the loop.

  For products of microseconds, where one call's dispatch would outweigh
  them. Each trip adds the last result's first element to the smaller
  operand, so that XLA can neither hoist the product out of the loop nor
  drop it; the same loop without the product is timed and subtracted.
  """
  smaller_first = a.size <= b.size

  def looped(a, b, with_product: bool):
    def trip(_, carry):
      x, y = (a + carry, b) if smaller_first else (a, b + carry)
      first = (product(x, y) if with_product else x if smaller_first else y)
      return first.reshape(-1)[0]
    return lax.fori_loop(0, _LOOP_TRIPS, trip, jnp.zeros((), a.dtype))

  # Operands as arguments, not constants a compiler could prepare ahead.
  runs = {name: jax.jit(functools.partial(looped, with_product=name == 'with'))
          for name in ('with', 'without')}
  for run in runs.values():
    run(a, b).block_until_ready()
  times = common.interleaved_seconds(
      {name: (lambda run=run: run(a, b).block_until_ready())
       for name, run in runs.items()}, repeats)
  return max(0.0, min(times['with']) - min(times['without'])) / _LOOP_TRIPS


def product_flops(lhs: tuple, rhs: tuple, dimension_numbers) -> int:
  """FLOPs of one dot_general: 2 x every lhs element x each rhs free column."""
  (_, rhs_contracting), (_, rhs_batch) = dimension_numbers
  return 2 * math.prod(lhs) * math.prod(
      n for i, n in enumerate(rhs) if i not in (*rhs_contracting, *rhs_batch))


def matmul_floor(matmuls: collections.Counter, timer, repeats: int):
  """Each product timed by timer, summed -> (floor s, GFLOP, one row each)."""
  rows, floor_s, flops = [], 0.0, 0.0
  for (lhs, rhs, dims), count in sorted(matmuls.items(),
                                        key=lambda item: -item[1]):
    a, b = jnp.ones(lhs, jnp.float32), jnp.ones(rhs, jnp.float32)
    product = jax.jit(lambda x, y, dims=dims: lax.dot_general(x, y, dims))
    gflop = product_flops(lhs, rhs, dims) / 1e9
    seconds = timer(product, a, b, repeats)
    floor_s += count * seconds
    flops += count * gflop
    rows.append({'count': count, 'lhs': lhs, 'rhs': rhs,
                 'contracting': dims[0], 'seconds': seconds,
                 'gflop_per_s': gflop / seconds if seconds else None})
  return floor_s, flops, rows


def measure(config, batch: int, length: int, repeats: int) -> dict:
  state = create_train_state(config, jax.random.key(0))
  data = train_bench.synthetic_batches(config, batch, length, 'full', 1)[0]
  step = jax.jit(lambda s, b, r: train_step(s, b, r, config))
  matmuls = dot_generals(
      jax.make_jaxpr(step)(state, data, jax.random.key(1)).jaxpr)
  floor_s, flops, rows = matmul_floor(matmuls, _seconds_alone, repeats)
  holder = [state]

  def one_step():
    holder[0], metrics = step(holder[0], data, jax.random.key(1))
    jax.block_until_ready(metrics)

  step_s = common.best_seconds(one_step, max(3, repeats // 3))
  return {'dot_generals': sum(matmuls.values()), 'matmul_floor_s': floor_s,
          'matmul_gflop': flops, 'matmul_gflop_per_s': flops / floor_s,
          'step_s': step_s, 'matmul_share': floor_s / step_s,
          'matmuls': rows}


def measure_search(config, beam_size: int, repeats: int) -> dict:
  """decode.py's search: its matmul floor against ours and the example's."""
  gen_len = 32
  params, src = decode_bench.random_model_and_sources(config)
  search = functools.partial(decode_bench.decode_without_eos, config=config,
                             beam_size=beam_size, gen_len=gen_len)
  matmuls = dot_generals(jax.make_jaxpr(search)(params, src).jaxpr,
                         loop_trips=gen_len)
  floor_s, flops, rows = matmul_floor(matmuls, _seconds_in_loop, repeats)
  searches = decode_bench.measure(config, params,
                                  decode_bench.flax_wmt_params(config), src,
                                  beam_size, gen_len, max(3, repeats // 2),
                                  annotated=False)
  ours_s, theirs_s = searches['decode_s'], searches['flax_wmt']['decode_s']
  return {'beam': beam_size, 'batch': src.shape[0], 'src_len': src.shape[1],
          'gen_len': gen_len, 'dot_generals': sum(matmuls.values()),
          'matmul_floor_s': floor_s, 'matmul_gflop': flops,
          'matmul_gflop_per_s': flops / floor_s,
          'search_s': ours_s, 'flax_wmt_search_s': theirs_s,
          'matmul_share': floor_s / ours_s, 'speedup': searches['speedup'],
          'speedup_interval': searches['speedup_interval'],
          'ceiling_speedup': theirs_s / floor_s, 'matmuls': rows}

def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='small',
                      choices=sorted(train_bench.SHAPES))
  parser.add_argument('--beam', type=int, choices=[1, 4],
                      help="decode.py's search with this beam (1: greedy) "
                      'instead of the training step')
  parser.add_argument('--repeats', type=int, default=15)
  args = parser.parse_args()
  if args.beam:
    config = get_config(args.config).replace(dropout_rate=0.0)
    common.emit({'benchmark': 'matmul_floor', 'config': args.config,
                 **measure_search(config, args.beam, args.repeats)})
    return
  batch, length = train_bench.SHAPES[args.config]
  config = get_config(args.config).replace(
      dropout_rate=0.1, label_smoothing=0.1, batch_size=batch,
      max_len=max(length + 1, 64))
  common.emit({'benchmark': 'matmul_floor', 'config': args.config,
               'batch': batch, 'length': length,
               **measure(config, batch, length, args.repeats)})


if __name__ == '__main__':
  main()
