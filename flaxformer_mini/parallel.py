"""Data parallelism: the same per-device step, wrapped from outside.

The pure `train_step` / `eval_step` take an `axis_name`; here
`jax.jit(jax.shard_map(step))` runs them on every device along the mesh axis
'data' of a `jax.sharding.Mesh`. The state is a global `jax.Array`
replicated over the mesh and the batch one split along 'data', which is also
what multi-host runs and orbax checkpoints need, so nothing converts between
them. Each device gets batch_size / num_devices rows; gradients and metric
sums are psum-ed over 'data', so 8 devices compute the update of the same
global batch as 1 device. In a multi-host run (multihost.py joins it) every
process holds batch_size / num_processes rows of the global batch (its own
shard of the data). The classic `jax.pmap` version of the same, for
comparison, is in docs/parallel.md.
"""

import dataclasses
import functools

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flaxformer_mini.config import ConfigError, TransformerConfig
from flaxformer_mini.masks import Batch
from flaxformer_mini.training import eval_step, train_step

DATA_AXIS = 'data'


def data_mesh() -> Mesh:
  """Every device of every process along the one axis 'data'."""
  return Mesh(np.array(jax.devices()), (DATA_AXIS,))


def replicated_sharding() -> NamedSharding:
  """A full copy on every device of the data mesh."""
  return NamedSharding(data_mesh(), P())


def rows_per_update(config: TransformerConfig) -> int:
  """The rows every global batch is a multiple of: one per device and
  micro-batch (config.grad_accumulation)."""
  return jax.device_count() * config.grad_accumulation


def check_divisible(rows: int, config: TransformerConfig,
                    what: str = 'batch_size') -> None:
  """A clear error, before compiling, when a batch of `rows` rows cannot be
  split evenly over the devices and into micro-batches.

  Raises:
    ConfigError: naming `what`.
  """
  multiple = rows_per_update(config)
  if rows % multiple:
    nearest = max(multiple, round(rows / multiple) * multiple)
    over = f'{jax.device_count()} devices' + (
        f' x {config.grad_accumulation} micro-batches (grad_accumulation)'
        if config.grad_accumulation > 1 else '')
    raise ConfigError(f'{what}={rows} does not divide over {over}; use a '
                      f'multiple of {multiple}, e.g. {nearest}.')


def pad_rows(array: np.ndarray, multiple: int, pad_id: int) -> np.ndarray:
  """Appends rows of pad so that the row count divides by `multiple`.

  Rows of all pad have no real target token, so they add nothing to the
  metric sums: evaluation then drops no example.
  """
  extra = -array.shape[0] % multiple
  return np.concatenate(
      [array, np.full((extra,) + array.shape[1:], pad_id, array.dtype)])


def _shard_token_counts(tgt_out, shards: int, pad_id: int):
  """Real target tokens of each consecutive block of rows: -> int32[shards]."""
  # numpy: the batch is on the host, and jnp would compile for every shape.
  per_row = np.sum(np.asarray(tgt_out) != pad_id, axis=1)
  return per_row.reshape(shards, -1).sum(axis=1).astype(np.int32)


def host_rows(array):
  """array: [batch, ...], the global rows -> [batch / processes, ...], this process's block."""
  rows = array.shape[0] // jax.process_count()
  start = jax.process_index() * rows
  return array[start:start + rows]


@dataclasses.dataclass(frozen=True)
class DataParallel:
  """Places state and batches on every device and runs the mapped steps.

  Use: `dp = DataParallel(config)`, `state = dp.replicate(state)`, then
  `state, metrics = dp.train_step(state, dp.put_batch(batch), rng)`;
  `dp.local_copy(state)` gives back one ordinary copy (for evaluation), and
  `dp.to_host(metrics)` the metrics as numpy. Metrics are global sums over
  every device (and host): float32[] loss_sum, int32[] ntokens and correct,
  float32[] learning_rate.
  """
  config: TransformerConfig

  @functools.cached_property
  def mesh(self) -> Mesh:
    return data_mesh()

  @property
  def num_devices(self) -> int:
    return jax.device_count()

  @property
  def replicated(self) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(self.mesh, P())

  @functools.cached_property
  def _batch_specs(self) -> Batch:
    sharded = P(DATA_AXIS)
    return Batch(src=sharded, tgt_in=sharded, tgt_out=sharded,
                 src_mask=sharded, tgt_mask=sharded, ntokens=sharded)

  def _per_device(self, step_fn):
    """shard_map's per-device view: ntokens arrives as int32[1], use a scalar."""
    def per_device(first, batch, *rest):
      return step_fn(first, batch.replace(ntokens=batch.ntokens[0]), *rest)
    return per_device

  @functools.cached_property
  def train_step(self):
    """(replicated state, placed Batch, rng) -> (replicated state, metrics).

    The input state is donated (its buffers are reused for the output).
    """
    step = functools.partial(train_step, config=self.config,
                             axis_name=DATA_AXIS)
    # check_vma=False: the step itself psums the gradients (with it, autodiff
    # would already sum them, and the step's psum would count every device
    # twice).
    mapped = jax.shard_map(
        self._per_device(step), mesh=self.mesh,
        in_specs=(P(), self._batch_specs, P()), out_specs=(P(), P()),
        check_vma=False)
    return jax.jit(mapped, donate_argnums=0)

  @functools.cached_property
  def eval_step(self):
    """(replicated params, placed Batch) -> metric sums (eval_step's)."""
    step = functools.partial(eval_step, config=self.config,
                             axis_name=DATA_AXIS)
    return jax.jit(jax.shard_map(
        self._per_device(step), mesh=self.mesh,
        in_specs=(P(), self._batch_specs), out_specs=P(), check_vma=False))

  def replicate(self, tree):
    """Any pytree of arrays [...] (a state, params) -> global arrays [...]
    replicated over the mesh: a full copy on every device."""
    replicated = self.replicated

    def put(leaf):
      if (isinstance(leaf, jax.Array) and
          leaf.sharding.is_equivalent_to(replicated, leaf.ndim)):
        return leaf  # already in place (e.g. restored from a checkpoint)
      value = np.asarray(leaf)
      return jax.make_array_from_callback(value.shape, replicated,
                                          lambda index: value[index])
    return jax.tree.map(put, tree)

  def put_batch(self, batch: Batch) -> Batch:
    """Splits this process's rows of the global batch over the devices.

    batch: a Batch whose arrays are this process's [batch / processes, ...]
    rows (see `host_rows`) -> the same Batch as global arrays split along
    'data', ntokens as int32[devices], each device's count. Raises
    ConfigError when the rows do not divide over the devices.
    """
    check_divisible(batch.src.shape[0] * jax.process_count(), self.config,
                    'the global batch size')
    counts = _shard_token_counts(batch.tgt_out, jax.local_device_count(),
                                 self.config.pad_id)
    return jax.tree.map(self.put_rows, batch.replace(ntokens=counts))

  def put_rows(self, rows):
    """rows: [rows, ...], this process's -> [rows * processes, ...] split over 'data'."""
    return jax.make_array_from_process_local_data(
        NamedSharding(self.mesh, P(DATA_AXIS)), np.asarray(rows))

  def local_copy(self, tree):
    """A replicated pytree -> one ordinary copy, on this process's first device."""
    return jax.tree.map(lambda x: x.addressable_data(0), tree)

  def to_host(self, tree):
    """A replicated pytree (metrics) -> numpy values on the host."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def decode_sharded(decode_fn, params, sources: np.ndarray,
                   parallel: DataParallel, pad_id: int) -> np.ndarray:
  """decode_fn(params, src) with the rows of `sources` split over the devices.

  sources: int32[n, src_len], the same on every process; topped up with rows
  of pad to divide over the devices, and those rows are dropped from the
  result: -> decode_fn's output as numpy, its first n rows.
  """
  padded = pad_rows(sources, parallel.num_devices, pad_id)
  out = decode_fn(parallel.replicate(params),
                  parallel.put_rows(host_rows(padded)))
  return np.asarray(multihost_utils.process_allgather(out, tiled=True))[
      :sources.shape[0]]
