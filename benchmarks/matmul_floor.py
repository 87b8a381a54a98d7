"""How much of the training step is matmuls: the step's matmul floor.

  python benchmarks/matmul_floor.py --config small

Every dot_general of the real training step (forward and backward, read from
its jaxpr) is timed alone at its own shapes and dimension numbers (best of
--repeats), and the times are summed with their multiplicities. Against the
whole step's time this says how much of the step the matmuls are, and so how
much any lever outside them can buy: a step can get no faster than its
matmuls, and a lever that does not change them can at most remove the rest.
float32, fixed synthetic batches of the issue's shapes (train_step.py's).
"""

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core

from flaxformer_mini.config import get_config
from flaxformer_mini.training import create_train_state, train_step

import common
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


def dot_generals(jaxpr) -> collections.Counter:
  """(lhs shape, rhs shape, dimension numbers) -> count, sub-jaxprs included.

  Of a lax.platform_dependent choice, only the branch of this backend counts.
  """
  found = collections.Counter()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      lhs, rhs = (v.aval for v in eqn.invars)
      found[(lhs.shape, rhs.shape, eqn.params['dimension_numbers'])] += 1
    if eqn.params.get('branches_platforms'):
      found.update(dot_generals(
          eqn.params['branches'][_this_platforms_branch(eqn)].jaxpr))
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax_core.ClosedJaxpr):
          found.update(dot_generals(sub.jaxpr))
        elif isinstance(sub, jax_core.Jaxpr):
          found.update(dot_generals(sub))
  return found


def measure(config, batch: int, length: int, repeats: int) -> dict:
  state = create_train_state(config, jax.random.key(0))
  data = train_bench.synthetic_batches(config, batch, length, 'full', 1)[0]
  step = jax.jit(lambda s, b, r: train_step(s, b, r, config))
  matmuls = dot_generals(
      jax.make_jaxpr(step)(state, data, jax.random.key(1)).jaxpr)
  rows, floor_s, flops = [], 0.0, 0.0
  for (lhs, rhs, dims), count in sorted(matmuls.items(),
                                        key=lambda item: -item[1]):
    a, b = jnp.ones(lhs, jnp.float32), jnp.ones(rhs, jnp.float32)
    product = jax.jit(lambda x, y, dims=dims: lax.dot_general(x, y, dims))
    out = jax.eval_shape(product, a, b)
    gflop = 2 * np.prod(out.shape) * np.prod([lhs[i] for i in dims[0][0]]) / 1e9
    seconds = common.best_seconds(
        lambda: product(a, b).block_until_ready(), repeats)
    floor_s += count * seconds
    flops += count * gflop
    rows.append({'count': count, 'lhs': lhs, 'rhs': rhs,
                 'contracting': dims[0], 'seconds': seconds,
                 'gflop_per_s': gflop / seconds})
  holder = [state]

  def one_step():
    holder[0], metrics = step(holder[0], data, jax.random.key(1))
    jax.block_until_ready(metrics)

  step_s = common.best_seconds(one_step, max(3, repeats // 3))
  return {'dot_generals': sum(matmuls.values()), 'matmul_floor_s': floor_s,
          'matmul_gflop': flops, 'matmul_gflop_per_s': flops / floor_s,
          'step_s': step_s, 'matmul_share': floor_s / step_s,
          'matmuls': rows}


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='small',
                      choices=sorted(train_bench.SHAPES))
  parser.add_argument('--repeats', type=int, default=15)
  args = parser.parse_args()
  batch, length = train_bench.SHAPES[args.config]
  config = get_config(args.config).replace(
      dropout_rate=0.1, label_smoothing=0.1, batch_size=batch,
      max_len=max(length + 1, 64))
  common.emit({'benchmark': 'matmul_floor', 'config': args.config,
               'batch': batch, 'length': length,
               **measure(config, batch, length, args.repeats)})


if __name__ == '__main__':
  main()
