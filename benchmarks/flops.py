"""FLOPs counted from the traced program, not restated from the model.

Every MFU figure divides these by a step's time. They are the matrix
products (`dot_general`) of the jaxpr, 2 x m x k x n each, so a variant of
the model (another feed-forward, another attention) is counted as it runs;
elementwise work, softmax and layer norms are left out, as MFU conventions
do (PaLM, appendix B).
"""

import functools
import math

import jax
import numpy as np
from jax.extend import core as jax_core

from flaxformer_mini.masks import make_batch
from flaxformer_mini.training import create_train_state, train_step


def _product_flops(eqn) -> int:
  """FLOPs of one dot_general: 2 x every lhs element x each rhs free column."""
  lhs, rhs = (v.aval.shape for v in eqn.invars)
  (_, rhs_contracting), (_, rhs_batch) = eqn.params['dimension_numbers']
  return 2 * math.prod(lhs) * math.prod(
      n for i, n in enumerate(rhs) if i not in (*rhs_contracting, *rhs_batch))


def _sub_jaxprs(eqn) -> list:
  subs = []
  for param in eqn.params.values():
    for sub in param if isinstance(param, (list, tuple)) else [param]:
      if isinstance(sub, jax_core.ClosedJaxpr):
        sub = sub.jaxpr
      if isinstance(sub, jax_core.Jaxpr):
        subs.append(sub)
  return subs


def jaxpr_flops(jaxpr) -> int:
  """The matrix-product FLOPs of one run of `jaxpr`, sub-programs included.

  A scan's body counts once per iteration, a cond's costliest branch once;
  a while loop has no count known before it runs, and is refused.
  """
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == 'dot_general':
      total += _product_flops(eqn)
    elif name == 'while':
      raise ValueError('a while loop has no FLOP count before it runs')
    subs = [jaxpr_flops(sub) for sub in _sub_jaxprs(eqn)]
    if name == 'cond':
      total += max(subs)
    elif name == 'scan':
      total += eqn.params['length'] * sum(subs)
    else:
      total += sum(subs)
  return total


def traced_flops(fn, *args) -> int:
  """The matrix-product FLOPs of fn(*args), from its jaxpr (nothing runs)."""
  return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def step_flops(config, batch: int, src_len: int, tgt_len: int) -> int:
  """The model FLOPs of one training step: forward and backward products.

  Counted without remat (recomputing a forward pass is work the hardware
  does, not the model's FLOPs) on a batch of `batch` pairs of those lengths.
  """
  config = config.replace(remat=False)
  ids = np.full((batch, max(src_len, tgt_len + 1)), config.bos_id, np.int32)
  state = jax.eval_shape(lambda: create_train_state(config, jax.random.key(0)))
  return traced_flops(functools.partial(train_step, config=config), state,
                      make_batch(ids[:, :src_len], ids[:, :tgt_len + 1],
                                 config), jax.random.key(1))
