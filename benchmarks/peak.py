"""The backend's matmul throughput: the denominator of every MFU figure.

  python benchmarks/peak.py

Jitted jnp.dot of square matrices (2048 and 4096; 8192 too on TPU and GPU,
whose matmul units 4096 does not fill), median of --repeats runs after a
warm-up, in GFLOP/s (2 n^3 flops per product); float32 always, bfloat16 too
where the backend has native bfloat16 matmuls (TPU, GPU). Prints one JSON
object whose `peak_gflops` holds the best median per dtype: the larger the
peak, the more honest (the lower) every MFU divided by it.
"""

import argparse

import jax
import jax.numpy as jnp

import common

SIZES = (2048, 4096)
ACCELERATOR_SIZES = SIZES + (8192,)


def matmul_gflops(n: int, dtype, repeats: int) -> float:
  keys = jax.random.split(jax.random.key(n), 2)
  a, b = (jax.random.normal(k, (n, n), dtype) for k in keys)
  product = jax.jit(jnp.dot).lower(a, b).compile()
  product(a, b).block_until_ready()  # warm-up
  seconds = common.median_seconds(lambda: product(a, b).block_until_ready(),
                                  repeats)
  return 2 * n**3 / seconds / 1e9


def measure(repeats: int = 7) -> dict:
  """{'float32': {size: GFLOP/s}, ..., 'peak_gflops': {dtype: best}}."""
  dtypes, sizes = ['float32'], SIZES
  if jax.default_backend() in ('tpu', 'gpu'):
    dtypes, sizes = ['float32', 'bfloat16'], ACCELERATOR_SIZES
  result = {dtype: {str(n): matmul_gflops(n, jnp.dtype(dtype), repeats)
                    for n in sizes} for dtype in dtypes}
  result['peak_gflops'] = {dtype: max(result[dtype].values())
                           for dtype in dtypes}
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--repeats', type=int, default=7)
  args = parser.parse_args()
  common.emit({'benchmark': 'peak', 'repeats': args.repeats,
               **measure(args.repeats)})


if __name__ == '__main__':
  main()
