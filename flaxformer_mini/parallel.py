"""Data parallelism: the same per-device step, wrapped from outside.

The pure `train_step` / `eval_step` take an `axis_name`; here they are wrapped
over every device along the mesh axis 'data', either by

  * `shard_map` (the default): `jax.jit(jax.shard_map(step))` over a
    `jax.sharding.Mesh`. This is JAX's recommended path: the state and the
    batch are global `jax.Array`s, which is also what multi-host runs and
    orbax checkpoints need; or by
  * `pmap`: the classic TPU path (in current JAX in maintenance mode and
    itself built on jit + shard_map), where arrays carry a leading
    [local_devices] axis.

Each device gets batch_size / num_devices rows; gradients and metric sums are
psum-ed over 'data', so 8 devices compute the update of the same global batch
as 1 device. In a multi-host run every process holds batch_size /
num_processes rows of the global batch (its own shard of the data).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flaxformer_mini.config import PARALLEL_MODES, TransformerConfig
from flaxformer_mini.masks import Batch
from flaxformer_mini.training import TrainState, eval_step, train_step

DATA_AXIS = 'data'


def initialize_multihost(coordinator_address: str | None = None,
                         num_processes: int | None = None,
                         process_id: int | None = None) -> None:
  """Joins JAX's multi-controller runtime (one process per host).

  On Cloud TPU pods and SLURM/Kubernetes GPU clusters JAX finds the other
  processes itself; elsewhere pass the coordinator's host:port, the number of
  processes and this process's index.
  """
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)


def check_divisible(batch_size: int, what: str = '--batch_size') -> None:
  """A clear error, before compiling, when a batch cannot be split evenly."""
  devices = jax.device_count()
  if batch_size % devices:
    lower = batch_size - batch_size % devices
    raise ValueError(
        f'{what}={batch_size} does not divide over {devices} devices; use a '
        f'multiple of {devices} (e.g. {lower or devices} or '
        f'{lower + devices}).')


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
  per_row = jnp.sum(jnp.asarray(tgt_out) != pad_id, axis=1)
  return per_row.reshape(shards, -1).sum(axis=1).astype(jnp.int32)


def host_rows(array):
  """This process's consecutive block of rows of a global [batch, ...] array."""
  rows = array.shape[0] // jax.process_count()
  start = jax.process_index() * rows
  return array[start:start + rows]


@dataclasses.dataclass(frozen=True)
class DataParallel:
  """Places state and batches on every device and runs the mapped steps.

  Use: `dp = DataParallel(config)`, `state = dp.put_state(state)`, then
  `state, metrics = dp.train_step(state, dp.put_batch(batch), rng)`;
  `dp.get_state(state)` gives back one ordinary copy (for evaluation or
  saving). Metrics come back as global sums.
  """
  config: TransformerConfig
  mode: str = 'shard_map'

  def __post_init__(self):
    if self.mode not in PARALLEL_MODES:
      raise ValueError(f'parallel mode {self.mode!r}: allowed values: '
                       f'{", ".join(PARALLEL_MODES)}.')

  @functools.cached_property
  def mesh(self) -> Mesh:
    return Mesh(np.array(jax.devices()), (DATA_AXIS,))

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
    """(state, placed batch, rng) -> (state, metrics); the state is donated."""
    step = functools.partial(train_step, config=self.config,
                             axis_name=DATA_AXIS)
    if self.mode == 'pmap':
      return jax.pmap(step, axis_name=DATA_AXIS, in_axes=(0, 0, None),
                      donate_argnums=0)
    # check_vma=False keeps pmap's semantics: the step itself psums the
    # gradients (with it, autodiff would already sum them, and the step's
    # psum would count every device twice).
    mapped = jax.shard_map(
        self._per_device(step), mesh=self.mesh,
        in_specs=(P(), self._batch_specs, P()), out_specs=(P(), P()),
        check_vma=False)
    return jax.jit(mapped, donate_argnums=0)

  @functools.cached_property
  def eval_step(self):
    """(params as placed by put_state, placed batch) -> metric sums."""
    step = functools.partial(eval_step, config=self.config,
                             axis_name=DATA_AXIS)
    if self.mode == 'pmap':
      return jax.pmap(step, axis_name=DATA_AXIS)
    return jax.jit(jax.shard_map(
        self._per_device(step), mesh=self.mesh,
        in_specs=(P(), self._batch_specs), out_specs=P(), check_vma=False))

  def put_state(self, state):
    """One replica of the state (or any pytree, e.g. params) on every device."""
    if self.mode == 'pmap':
      local = jax.local_device_count()
      return jax.tree.map(
          lambda x: np.broadcast_to(x, (local,) + np.shape(x)), state)
    return self.replicate(state)

  def get_state(self, state: TrainState) -> TrainState:
    """One ordinary copy of a replicated state, on this process's first device."""
    if self.mode == 'pmap':
      return jax.tree.map(lambda x: x[0], state)
    return jax.tree.map(lambda x: x.addressable_data(0), state)

  def savable_state(self, state: TrainState) -> TrainState:
    """The placed state as global arrays, for orbax (multi-host aware)."""
    return self.get_state(state) if self.mode == 'pmap' else state

  def put_batch(self, batch: Batch) -> Batch:
    """Splits this process's rows of the global batch over the devices.

    batch: a Batch whose arrays are this process's [batch / processes, ...]
    rows (see `host_rows`). Raises ValueError when they do not divide.
    """
    rows = batch.src.shape[0] * jax.process_count()
    check_divisible(rows, 'the global batch size')
    local = jax.local_device_count()
    counts = _shard_token_counts(batch.tgt_out, local, self.config.pad_id)
    if self.mode == 'pmap':
      split = lambda x: jnp.reshape(x, (local, -1) + x.shape[1:])
      arrays = {f.name: split(getattr(batch, f.name))
                for f in dataclasses.fields(Batch) if f.name != 'ntokens'}
      return Batch(**arrays, ntokens=counts)
    return jax.tree.map(self.put_rows, batch.replace(ntokens=counts))

  def replicate(self, tree):
    """Any pytree of arrays, replicated over the mesh (e.g. params to decode)."""
    replicated = self.replicated

    def put(leaf):
      if (isinstance(leaf, jax.Array) and
          leaf.sharding.is_equivalent_to(replicated, leaf.ndim)):
        return leaf  # already in place (e.g. restored from a checkpoint)
      value = np.asarray(leaf)
      return jax.make_array_from_callback(value.shape, replicated,
                                          lambda index: value[index])
    return jax.tree.map(put, tree)

  def put_rows(self, rows):
    """This process's rows [rows, ...] -> a global array split over 'data'."""
    return jax.make_array_from_process_local_data(
        NamedSharding(self.mesh, P(DATA_AXIS)), np.asarray(rows))

  def fetch(self, tree):
    """Metrics (replicated global sums) as host numpy values."""
    if self.mode == 'pmap':
      return jax.device_get(jax.tree.map(lambda x: x[0], tree))
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
