"""Translating many sentences at once, on the host: what the translate command
and a run's evaluations do with decoding.py's traceable searches.

Sources are sorted by length into batches, all padded to the input's
longest source (one shape; each sentence's output still limited by its
own length), each batch's rows split over every local device
(`jax.shard_map`, every device searching its share on its own); each
batch's beam search runs in stages, so that sentences
whose search has ended leave it on the way, its key/value cache grown in
windows (or, with refill, in slots that take the next sentence as one
ends); one jitted program is kept per shape for the process (and on disk for the next one, where the caller passes a
`compilation_cache.Executables`); `search_bytes` and `device_memory_bytes`
let the command refuse a search that cannot fit.
"""

import dataclasses
import functools
import os
import resource

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.decoding import (cache_windows, check_max_len,
                                      context_tokens_to_logits,
                                      default_max_len, greedy_decode,
                                      init_cache, own_limits, sample_decode,
                                      slot_cache, slot_tokens_to_logits,
                                      source_context, tokens_before_eos)
from flaxformer_mini.search import (BeamState, check_stopping, fill_slots,
                                    run_beam_search, run_slots,
                                    start_beam_search, start_slots,
                                    take_items)


def _start_beams(src, config: TransformerConfig, beam_size: int,
                 max_len: int) -> BeamState:
  """Transformer(config)'s beam search of the sources src: int32[rows,
  src_len] before its first step, each limited to its own length + 50."""
  check_max_len(config, max_len)
  return start_beam_search(init_cache(config, src.shape[0], max_len),
                           batch_size=src.shape[0], beam_size=beam_size,
                           max_len=max_len, bos_id=config.bos_id,
                           pad_id=config.pad_id,
                           limits=own_limits(src, config, max_len))


def _run_beams(params, context, state: BeamState, config: TransformerConfig,
               alpha: float, until_searching: int, finished_first: bool,
               stopping: str, grow_cache: bool,
               past_windows: bool = True) -> BeamState:
  """`run_beam_search` with Transformer(config) reading the sources'
  `context` (`source_context`), one row per item of `state`, with grow_cache
  its cache grown window by window (`cache_windows`; past_windows: see
  `run_beam_search`)."""
  return run_beam_search(
      context_tokens_to_logits(params, config, context), state, alpha=alpha, bos_id=config.bos_id,
      eos_id=config.eos_id, pad_id=config.pad_id,
      until_searching=until_searching, finished_first=finished_first,
      stopping=stopping,
      windows=cache_windows(state.max_len) if grow_cache else None,
      past_windows=past_windows)


# A batch's rows split over the devices: each searches its own share, on
# its own (a device's while_loop stops when its items are done, not another's).
_AXIS = 'sentences'
_ROWS = P(_AXIS)


def _on_devices(per_device, mesh: Mesh, in_specs):
  """per_device run by every device of `mesh` on its rows; its outputs are
  [rows, ...] per device, joined along the rows."""
  return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs,
                       out_specs=_ROWS, check_vma=False)


def _first_stage(params, src, *, mesh: Mesh, config: TransformerConfig,
                 beam_size: int, max_len: int, **search):
  """The beam search of the sources src: int32[rows, src_len] from its start
  until, on each device, at most search['until_searching'] of its items are
  still searching, or, where a later stage follows (until_searching > 0), at
  the end of its cache's last window -> (the BeamState, its step
  int32[devices], each device's; the sources' `source_context`, for a later
  stage)."""
  def per_device(params, src):
    context = source_context(params, src, config)
    state = _start_beams(src, config, beam_size, max_len)
    # Its loop over the whole cache would cost the compile a loop body
    # (about 1.5 s of a cold command, docs/performance.md) for steps that
    # the Multi30k sets' first stages never reach: a later stage takes
    # them instead.
    state = _run_beams(params, context, state, config,
                       past_windows=not search['until_searching'], **search)
    return state.replace(step=state.step[None]), context
  return _on_devices(per_device, mesh, (P(), _ROWS))(params, src)


def _later_stage(params, state: BeamState, context, items, *, mesh: Mesh,
                 config: TransformerConfig, **search):
  """The search of `state`'s items `items` (int32[rows], each device's
  indices into its own rows) alone, on from its step, reading their rows of
  the stage before's `context`: the encoder does not run again ->
  (BeamState, context) as `_first_stage`'s."""
  def per_device(params, state, context, items):
    state = take_items(state.replace(step=state.step[0]), items)
    context = jax.tree.map(lambda leaf: leaf[items], context)
    state = _run_beams(params, context, state, config, **search)
    return state.replace(step=state.step[None]), context
  return _on_devices(per_device, mesh, (P(), _ROWS, _ROWS, _ROWS))(
      params, state, context, items)


def _start_slots(params, *, config: TransformerConfig, slots: int,
                 beam_size: int, max_len: int, src_len: int) -> BeamState:
  """Beam search in `slots` empty slots for sources of src_len tokens."""
  shapes = jax.eval_shape(lambda src: slot_cache(params, src, config, max_len),
                          jax.ShapeDtypeStruct((slots, src_len), jnp.int32))
  cache, context = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return start_slots(cache, context, slots=slots, beam_size=beam_size,
                     max_len=max_len, bos_id=config.bos_id,
                     pad_id=config.pad_id)


def _fill(params, state: BeamState, src, slots, *,
          config: TransformerConfig) -> BeamState:
  """The sources src: int32[k, src_len] started in the slots `slots`
  (int32[k]; past the last: none), each limited to its own length + 50."""
  return fill_slots(state, slots,
                    *slot_cache(params, src, config, state.max_len),
                    bos_id=config.bos_id, pad_id=config.pad_id,
                    limits=own_limits(src, config, state.max_len))


def _advance(params, state: BeamState, until_done, *,
             config: TransformerConfig, alpha: float, finished_first: bool,
             stopping: str) -> BeamState:
  """The slots' searches on until at least until_done (int32[]) are done."""
  return run_slots(slot_tokens_to_logits(params, config, state.max_len),
                   state, until_done=until_done, alpha=alpha,
                   bos_id=config.bos_id, eos_id=config.eos_id,
                   pad_id=config.pad_id, finished_first=finished_first,
                   stopping=stopping)


def _greedy(params, src, *, mesh: Mesh, config: TransformerConfig):
  return _on_devices(lambda params, src: greedy_decode(params, src, config),
                     mesh, (P(), _ROWS))(params, src)


def _sample(params, src, keys, temperature, top_p, *, mesh: Mesh, **static):
  return _on_devices(
      lambda params, src, keys, temperature, top_p: sample_decode(
          params, src, rng=keys, temperature=temperature, top_p=top_p,
          **static), mesh, (P(), _ROWS, _ROWS, P(), P()))(
              params, src, keys, temperature, top_p)


# One jitted program per shape for the process: a later call (the next
# evaluation, the next input) with the same shapes reuses the compiled one.
# Their keyword arguments are the static ones (`Executables` keeps them).
_SEARCH = ('mesh', 'config', 'alpha', 'until_searching', 'finished_first',
           'stopping', 'grow_cache')
_jit_first_stage = jax.jit(_first_stage, static_argnames=_SEARCH + (
    'beam_size', 'max_len'))
_jit_later_stage = jax.jit(_later_stage, static_argnames=_SEARCH)
# The slots' state is handed over whole from call to call: donated, its
# key/value cache is updated in place instead of copied.
_jit_start_slots = jax.jit(_start_slots, static_argnames=(
    'config', 'slots', 'beam_size', 'max_len', 'src_len'))
_jit_fill = jax.jit(_fill, static_argnames=('config',),
                    donate_argnames=('state',))
_jit_advance = jax.jit(_advance, static_argnames=(
    'config', 'alpha', 'finished_first', 'stopping'),
                       donate_argnames=('state',))
_jit_greedy = jax.jit(_greedy, static_argnames=('mesh', 'config'))
_jit_sample = jax.jit(_sample, static_argnames=(
    'mesh', 'config', 'num_samples', 'top_k'))


def _just_jit(name: str, jitted, *args, **static):
  """Calls a jitted program without keeping it on disk (`Executables` does)."""
  del name
  return jitted(*args, **static)


def search_bytes(config: TransformerConfig, batch_size: int,
                 beam_size: int) -> int:
  """About how much device memory a beam search of `batch_size` sources of
  up to config.max_len tokens takes with `beam_size` beams, beside the
  state of the next batch's search (`_one_batch_ahead` holds both).

  Per beam row: the self-attention key/value cache three times (twice in
  the search, as it is reordered with the beams; once in the state beside
  it), float32 logits, log-probabilities and candidates over the
  vocabulary, and the live, finished and candidate sequences (in both);
  per source, the cross-attention keys and values (read by all of its
  beams).
  """
  rows = batch_size * beam_size
  itemsize = jnp.dtype(config.dtype).itemsize
  layer_cache = (config.num_decoder_layers * 2 * config.max_len *
                 config.d_model * itemsize)  # keys and values, every layer
  per_row = (layer_cache * 3 + 3 * config.tgt_vocab_size * 4 +
             2 * 8 * (config.max_len + 1) * 4)
  return rows * per_row + batch_size * layer_cache


def device_memory_bytes() -> int | None:
  """The memory of each of this process's devices, or None where it is not
  known. CPU devices share the host's (within the process's address-space
  limit): each has its share."""
  devices = jax.local_devices()
  stats = (devices[0].memory_stats()
           if hasattr(devices[0], 'memory_stats') else None)
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  if devices[0].platform != 'cpu':
    return None
  limits = [os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')]
  address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
  if address_space != resource.RLIM_INFINITY:
    limits.append(address_space)
  return min(limits) // len(devices)


def _next_rows(rows: int) -> int:
  """The rows of the next stage: a quarter, rounded up to a multiple of 8
  (0: this stage is the last).

  A quarter, not a half: each stage's batch shape is one more program to
  compile, and on the Multi30k test set 64 -> 16 rows saves almost all that
  64 -> 32 -> 16 -> 8 does (docs/multi30k.md).
  """
  return 0 if rows <= 16 else -(-rows // 32) * 8


def _put_rows(mesh: Mesh, rows):
  """rows: [rows, ...] on the host -> split over the devices of `mesh`."""
  return jax.device_put(rows, NamedSharding(mesh, _ROWS))


def _later_stage_arguments(params, rows: int, mesh: Mesh, first):
  """The arguments of the later stage that follows a first stage, `rows`
  items per device, as shapes: (params, the first stage's state and
  context, the items kept); first: the first stage's result as
  jax.ShapeDtypeStructs."""
  def on_rows(shape, dtype, weak_type=False):
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type,
                                sharding=NamedSharding(mesh, _ROWS))
  state, context = jax.tree.map(
      lambda s: on_rows(s.shape, s.dtype, s.weak_type), first)
  return params, state, context, on_rows((rows * mesh.devices.size,),
                                         jnp.int32)


def _beam_search_in_stages(params, src: np.ndarray, config: TransformerConfig,
                           beam_size: int, alpha: float, max_len: int,
                           shrink: bool, finished_first: bool, stopping: str,
                           grow_cache: bool, mesh: Mesh, programs=_just_jit):
  """The best hypothesis of each source: int32[rows, src_len] -> [rows, max_len].

  A search of `_one_batch_ahead`: it yields each time it has called a
  stage's program, and returns the result. One beam search in stages, its
  rows split over the devices of `mesh`: once no more than a quarter of a
  device's items are still searching, its finished ones are collected and
  the rest go on alone in a batch a quarter the size, so sentences that end
  early stop paying for the slowest one. Each item's result is the
  one-batch search's (an item's search never looks at another's).
  shrink=False: one stage. Two programs per source shape: the first stage,
  and a later one; a third, the later stage at the first one's width, only
  where a first stage ends at its cache's last window with more than a
  quarter of a device's items still searching (runaway hypotheses of a
  model early in its training).
  """
  devices = mesh.devices.size
  best = np.zeros((src.shape[0], max_len), np.int32)
  owner = np.arange(src.shape[0])  # the source row of each state row
  rows = len(owner) // devices  # each device's
  search = dict(mesh=mesh, config=config, alpha=alpha,
                finished_first=finished_first, stopping=stopping,
                grow_cache=grow_cache)
  next_rows = _next_rows(rows) if shrink else 0
  on_devices = _put_rows(mesh, src)
  if next_rows and hasattr(programs, 'ahead'):
    # A process that compiles the first stage compiles the later one too:
    # both at once (the later one's tracing and compiling beside XLA's
    # compiling of the first).
    programs.ahead('later_stage', _jit_later_stage, functools.partial(
        _later_stage_arguments, params, next_rows, mesh),
                   after='first_stage', until_searching=_next_rows(next_rows),
                   **search)
  state, context = programs('first_stage', _jit_first_stage, params,
                            on_devices,
                   beam_size=beam_size, max_len=max_len,
                   until_searching=next_rows, **search)
  yield
  while True:
    # Copied whole, sliced on the host: no eager op to compile per shape.
    finished = np.asarray(state.finished_sequences)[:, 0, 1:]
    ended = (np.asarray(state.done) | (next_rows == 0) |
             (np.repeat(np.asarray(state.step), rows) >= max_len))
    best[owner[ended]] = finished[ended]
    if ended.all():
      return best
    # Each device keeps its own searching items; filler rows repeat one
    # (the same search, the same result), or, on a device whose items have
    # all ended, an ended one, which takes no step. More of them than the
    # next stage's rows (a first stage stopped at its last window) go on at
    # this width first.
    searching = (~ended).reshape(devices, rows).sum(axis=1).max()
    width = next_rows if searching <= next_rows else rows
    keep = np.concatenate([
        np.resize(np.flatnonzero(~done) if not done.all() else [0], width)
        for done in ended.reshape(devices, rows)])
    owner = owner.reshape(devices, rows)[
        np.repeat(np.arange(devices), width), keep]
    rows = width
    next_rows = _next_rows(rows) if shrink else 0
    state, context = programs('later_stage', _jit_later_stage, params,
                              state, context,
                              _put_rows(mesh, keep.astype(np.int32)),
                              until_searching=next_rows, **search)
    yield


def search_in_slots(fill, advance, count: int, slots: int,
                    fill_rows: int) -> np.ndarray:
  """Runs `count` items' searches through `slots` slots, refilled as items
  end: -> int32[count, max_len], each item's best hypothesis.

  fill(slot_ids int32[fill_rows], items int32[fill_rows]) starts the items
  in those slots (slot id `slots`: none; its item repeats a real one);
  advance(until_done) steps every slot until at least until_done are done
  and returns (bool[slots] done, int32[slots, max_len] each slot's best
  hypothesis). Items are started in order, fill_rows at a time: the slots
  wait until that many are free, so that starting items (the encoder, for
  the Transformer) runs on fill_rows sources at once.
  """
  owner = np.full(slots, -1)  # the item each slot searches; -1: none
  best, started = None, 0
  while True:
    free = np.flatnonzero(owner < 0)
    while len(free) and started < count:
      ids = free[:min(fill_rows, count - started)]
      items = np.arange(started, started + len(ids))
      unused = fill_rows - len(ids)
      fill(np.append(ids, [slots] * unused).astype(np.int32),
           np.append(items, [items[0]] * unused).astype(np.int32))
      owner[ids], started, free = items, started + len(ids), free[len(ids):]
    if (owner < 0).all():
      return best
    done, hypotheses = advance(fill_rows if started < count else slots)
    if best is None:
      best = np.zeros((count,) + hypotheses.shape[1:], np.int32)
    ended = done & (owner >= 0)
    best[owner[ended]] = hypotheses[ended]
    owner[ended] = -1


def _beam_search_in_slots(params, src: np.ndarray, config: TransformerConfig,
                          beam_size: int, alpha: float, max_len: int,
                          slots: int, finished_first: bool, stopping: str,
                          programs=_just_jit) -> np.ndarray:
  """The best hypothesis of each source: int32[rows, src_len] -> [rows,
  max_len], searched in `slots` slots refilled as sentences end (three
  programs whatever the number of sources)."""
  state = programs('start_slots', _jit_start_slots, params, config=config,
                   slots=slots, beam_size=beam_size, max_len=max_len,
                   src_len=src.shape[1])
  # Placed as the parameters are, as every later state is (made from them):
  # one placement, one compiled fill.
  state = jax.device_put(state, jax.tree.leaves(params)[0].sharding)

  def fill(slot_ids, items):
    nonlocal state
    state = programs('fill', _jit_fill, params, state, src[items], slot_ids,
                     config=config)

  def advance(until_done):
    nonlocal state
    state = programs('advance', _jit_advance, params, state,
                     np.int32(until_done), config=config, alpha=alpha,
                     finished_first=finished_first, stopping=stopping)
    # Copied whole, sliced on the host: no eager op to compile.
    return (np.asarray(state.done),
            np.asarray(state.finished_sequences)[:, 0, 1:])

  return search_in_slots(fill, advance, len(src), slots,
                         fill_rows=max(1, slots // 8))


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Translations drawn from the model instead of searched (`sample_decode`).

  Sentence i of a call draws with the key fold_in(key(seed), i): its samples
  are the same whatever the batch it lands in.
  """
  seed: int = 0
  num_samples: int = 1  # translations per sentence
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0


def _rows_per_device(count: int, batch_size: int, devices: int) -> int:
  """The sentences per device of each batch for an input of `count`:
  batch_size, or, where the input cannot fill one batch, the least power of
  two from 8 up that holds it. A line or two is then not searched among a
  batch of copies of itself (one line on two devices: 8 rows each, not 64),
  and small inputs still share a few batch shapes, and so their kept
  programs."""
  needed = -(-count // devices)
  return min(batch_size, max(8, 1 << max(needed - 1, 0).bit_length()))


def _length_batches(config: TransformerConfig, sources: list[list[int]],
                    batch_size: int, devices: int = 1):
  """The non-empty sources sorted by length into batches of batch_size rows
  per device: yields (members, src int32[devices * batch_size, length]),
  row r holding the ids + eos of source members[r] (None: a filler row,
  repeating the batch's first source; its output is dropped).

  Every batch has one length, the longest source's rounded up to a
  multiple of 16: one shape, so two programs for the whole input (a file
  of similar length reuses them). A shorter source's output is still
  limited by its own length (`own_limits`); its steps attend over the
  padding too (5 % slower on 5,000 Multi30k train lines, docs/performance.md,
  "One source length per input"). The rows are dealt to the devices in
  turn (device d's share, rows d * batch_size ..., is the batch's d-th,
  d + devices-th, ... shortest), so every device's share spans the batch's
  lengths alike. Sources longer than config.max_len - 1 are cut there.
  """
  limit = config.max_len - 1  # room for eos
  order = sorted((i for i, ids in enumerate(sources) if len(ids)),
                 key=lambda i: len(sources[i]))
  if not order:
    return
  longest = len(sources[order[-1]]) + 1  # with eos
  length = min(-(-longest // 16) * 16, config.max_len)
  size = batch_size * devices
  for start in range(0, len(order), size):
    ranked = order[start:start + size]
    ranked += [None] * (size - len(ranked))
    members = [ranked[i * devices + d]
               for d in range(devices) for i in range(batch_size)]
    src = np.full((size, length), config.pad_id, np.int32)
    for row, member in enumerate(members):
      ids = list(sources[ranked[0] if member is None else member][:limit])
      src[row, :len(ids) + 1] = ids + [config.eos_id]
    yield members, src


def _draw(params, src, members: list, config: TransformerConfig,
          sampling: Sampling, mesh: Mesh, programs):
  """sample_decode with each member's own key: -> int32[rows, n, max_len],
  a search of `_one_batch_ahead`."""
  # Filler rows repeat the batch's first source (row 0), as
  # _length_batches fills them.
  rows = [members[0] if member is None else member for member in members]
  keys = jax.vmap(jax.random.fold_in, (None, 0))(
      jax.random.key(sampling.seed), jnp.asarray(rows, jnp.uint32))
  drawn = programs(
      'sample', _jit_sample, params, _put_rows(mesh, src),
      _put_rows(mesh, keys), jnp.float32(sampling.temperature),
      jnp.float32(sampling.top_p), mesh=mesh, config=config,
      num_samples=sampling.num_samples, top_k=sampling.top_k)
  yield
  return np.asarray(drawn)


def _one_batch_ahead(batches):
  """(members, result) for each (members, search) of `batches`, in order.

  A search is a generator that yields each time it has called a program
  (JAX runs it on the devices meanwhile) and returns its batch's result.
  Each batch's search is started, its first program queued behind the
  work already there, before the one before it waits on the devices: while
  the host reads a stage's result and prepares the next stage, the devices
  search the next batch instead of waiting (and a cold process's later
  stage has one batch's search more to finish compiling). Two batches'
  searches are held at once.
  """
  batches = iter(batches)

  def started():  # (members, the search or None, its result or None)
    for members, search in batches:
      try:
        next(search)
        return members, search, None
      except StopIteration as done:  # searched without a program to wait on
        return members, None, done.value
    return None

  following = started()
  while following:
    members, search, result = following
    following = started()
    while search is not None:
      try:
        next(search)
      except StopIteration as done:
        search, result = None, done.value
    yield members, result


def translate_ids(params, config: TransformerConfig, sources: list[list[int]],
                  *, beam_size: int = 4, alpha: float | None = None,
                  batch_size: int = 64, shrink_batches: bool = True,
                  finished_first: bool = True, stopping: str | None = None,
                  grow_cache: bool = True, refill: bool = False,
                  sampling: Sampling | None = None,
                  executables=None) -> list[list[int]]:
  """The best translation of each source (token ids, no eos), in order.

  Each source is its token ids without eos (eos and pad are added here).
  alpha None, stopping None: the config's eval_alpha and eval_stopping, as
  the translate command and a run's evaluations decode (stopping: see
  `beam_search`).

  Sources are sorted by length into batches of `batch_size` sentences per
  device (an input too small to fill one batch: the least power of two
  from 8 that holds it, `_rows_per_device`), so that the sentences of a
  batch tend to end at similar steps;
  each batch is split over all of this process's devices
  (`jax.local_devices()`: the GPUs of a node, or a CPU host's devices,
  which the translate command makes one per core), each searching its
  share on its own (`_beam_search_in_stages`). Each batch is padded to the
  input's longest (`_length_batches`: one shape, two programs for the
  Multi30k test set) and its output limited to its own length + 50
  (`decoding.own_limits`), so its translation does not depend on the other
  sources. With shrink_batches the sentences whose beam search
  has ended leave their batch on the way (`_beam_search_in_stages`): the
  same translations as one stage (shrink_batches=False), 1.4x faster on the
  Multi30k test set once compiled, for a second program per batch shape.
  Each batch's first stage is called before the host waits on the batch
  before it (`_one_batch_ahead`), so the devices search on meanwhile.
  beam_size 1 is greedy search; finished_first: see `beam_search`;
  grow_cache: see `beam_decode` (the same translations, 1.6x faster on the
  Multi30k test set, for more loop bodies to compile). refill: search in
  `batch_size` slots on the first device instead, each taking the next source as soon as its
  own is done (`search.start_slots`): each translation is the one the
  source gets searched alone, and three programs serve any input; on a CPU
  1.6x slower than the stages on the Multi30k test set: 11 % fewer
  row-steps, each 1.8x the cost, as a slot attends over its whole cache
  (docs/performance.md, "Rows that refill"). With
  `sampling`, translations are drawn instead, sampling.num_samples per
  source, consecutive in the list returned. An empty source gives an empty
  translation; sources longer than config.max_len - 1 are cut there.
  executables: a `compilation_cache.Executables` that keeps the compiled
  programs on disk for the next process (the translate command's); None:
  this process's jit cache only.
  """
  programs = executables or _just_jit
  alpha = config.eval_alpha if alpha is None else alpha
  stopping = config.eval_stopping if stopping is None else stopping
  check_stopping(stopping)
  draws = sampling.num_samples if sampling else 1
  outputs = [[] for _ in range(len(sources) * draws)]
  in_slots = refill and beam_size > 1 and not sampling
  devices = jax.local_devices()[:1] if in_slots else jax.local_devices()
  mesh = Mesh(np.array(devices), (_AXIS,))
  # Parameters of any origin (a host copy, as averaging gives, or a training
  # state's device copy) become one copy on every device: a jitted program
  # is compiled per placement of its arguments, and is reused only for the
  # same.
  params = jax.device_put(params, NamedSharding(mesh, P()))
  # In slots the sources are one batch: one shape, 3 programs.
  count = sum(1 for ids in sources if len(ids))

  def search(members, src):  # a search of _one_batch_ahead
    max_len = default_max_len(config, src.shape[1])
    if in_slots:
      best = _beam_search_in_slots(
          params, src, config, beam_size, alpha, max_len,
          min(batch_size, -(-len(src) // 8) * 8), finished_first, stopping,
          programs)
    elif sampling:
      best = yield from _draw(params, src, members, config, sampling, mesh,
                              programs)
    elif beam_size == 1:
      best = programs('greedy', _jit_greedy, params, _put_rows(mesh, src),
                      mesh=mesh, config=config)
      yield
      best = np.asarray(best)
    else:
      best = yield from _beam_search_in_stages(
          params, src, config, beam_size, alpha, max_len, shrink_batches,
          finished_first, stopping, grow_cache, mesh, programs)
    return best.reshape(len(src), draws, max_len)

  for members, best in _one_batch_ahead(
      (members, search(members, src)) for members, src in _length_batches(
          config, sources, max(count, 1) if in_slots else
          _rows_per_device(count, batch_size, len(devices)), len(devices))):
    for row, i in enumerate(members):
      for draw in range(draws if i is not None else 0):
        outputs[i * draws + draw] = tokens_before_eos(
            best[row, draw], config.eos_id, config.pad_id)
  return outputs


def translate_lines(params, config: TransformerConfig, tokenizer,
                    lines: list[str], *, beam_size: int = 4,
                    alpha: float | None = None, batch_size: int = 64,
                    warn=None, finished_first: bool = True,
                    stopping: str | None = None, refill: bool = False,
                    sampling: Sampling | None = None,
                    executables=None) -> list[str]:
  """Translations of `lines`, in order; '' for an empty line.

  tokenizer: the run's sentencepiece.SentencePieceProcessor (`load_run`).
  Sources longer than config.max_len - 1 tokens are cut there and reported
  through `warn(line_number, length)`. See translate_ids for the search
  (batch_size sentences on each device, every local device searching):
  alpha and stopping None are the config's eval_alpha and eval_stopping, as
  the translate command uses; refill: see translate_ids; with `sampling`,
  sampling.num_samples translations per line, consecutive; executables:
  see translate_ids.
  """
  encoded = [tokenizer.encode(line.strip()) if line.strip() else []
             for line in lines]
  for number, ids in enumerate(encoded, start=1):
    if len(ids) > config.max_len - 1 and warn is not None:
      warn(number, len(ids))
  return [tokenizer.decode(ids) for ids in translate_ids(
      params, config, encoded, beam_size=beam_size, alpha=alpha,
      batch_size=batch_size, finished_first=finished_first, stopping=stopping,
      refill=refill, sampling=sampling, executables=executables)]
