"""The tensor tour: every named tensor of one forward pass, in order, with its shape.

Runs the Transformer on one batch with the 'intermediates' collection
mutable, so every `sow` in the model (embeddings, positional encoding, per
layer and per head Q/K/V, scores, attention weights, concatenated heads,
output projection, sublayer outputs) comes back, then adds the batch itself
and the logits. Each stop names its axes, because shapes are what one gets
lost in.

    python -m flaxformer_mini.tour --config toy            # random weights
    python -m flaxformer_mini.tour --workdir runs/copy     # a trained model
    python train.py --task=copy --config=toy --tour        # the same table
"""

import dataclasses

import flax.traverse_util
import jax
import numpy as np

from flaxformer_mini import cli
from flaxformer_mini import config as config_lib
from flaxformer_mini import workdir
from flaxformer_mini.checkpoints import CheckpointError
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.data import DataError
from flaxformer_mini.masks import Batch, make_batch
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import init_params

# Axes of each sown tensor; {q} and {k} are filled in per attention block.
_AXES = {
    'token_embedding': '[batch, {q}, d_model]',
    'encoding': '[batch, {q}, d_model]',
    'embedded': '[batch, {q}, d_model]',
    'query': '[batch, heads, {q}, d_k]',
    'key': '[batch, heads, {k}, d_k]',
    'value': '[batch, heads, {k}, d_k]',
    'scores': '[batch, heads, {q}, {k}]',
    'weights': '[batch, heads, {q}, {k}]',
    'heads': '[batch, heads, {q}, d_k]',
    'concatenated': '[batch, {q}, heads * d_k = d_model]',
    'hidden': '[batch, {q}, d_ff]',
    'output': '[batch, {q}, d_model]',
    'after_self_attention': '[batch, {q}, d_model]',
    'after_cross_attention': '[batch, {q}, d_model]',
    'after_feed_forward': '[batch, {q}, d_model]',
}


@dataclasses.dataclass(frozen=True)
class Stop:
  """One tensor of the tour.

  Attributes:
    name: its path, e.g. 'decoder/layer_0/cross_attention/weights'.
    axes: what each dimension is, e.g. '[batch, heads, tgt_len, src_len]'.
    value: the tensor (numpy), or only its jax.ShapeDtypeStruct in a tour
      without parameters.
  """
  name: str
  axes: str
  value: np.ndarray | jax.ShapeDtypeStruct

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.value.shape)


def example_batch(config: TransformerConfig) -> Batch:
  """The walkthrough's batch: 2 pairs, source length 3, target length 2.

  Both pairs are copies shown over their first two target positions, as in
  the walkthrough: source [5, 6, 7] reads tgt_in [bos, 5] and must predict
  tgt_out [5, 6]; source [8, 9, pad] (one pad, so the padding mask has
  something to hide) reads [bos, 8] and must predict [8, 9]. A trained copy
  model predicts exactly tgt_out. Ids 3.. are ordinary tokens, so any
  vocabulary of 10 or more fits.
  """
  pad, bos = config.pad_id, config.bos_id
  src = np.array([[5, 6, 7], [8, 9, pad]])
  tgt = np.array([[bos, 5, 6], [bos, 8, 9]])
  return make_batch(src, tgt, config)


def _axes(path: tuple[str, ...]) -> str:
  """Axis names of the sown tensor at path (side, ..., block, name)."""
  own = 'src_len' if path[0] == 'encoder' else 'tgt_len'
  keys = 'src_len' if 'cross_attention' in path else own
  return _AXES[path[-1]].format(q=own, k=keys)


# Within a layer, blocks run in this order; within a block, tensors in _AXES's.
_BLOCKS = ('self_attention', 'after_self_attention', 'cross_attention',
           'after_cross_attention', 'feed_forward', 'after_feed_forward')


def _forward_order(path: tuple[str, ...]):
  """Sort key putting sown tensors in the order the forward pass makes them."""
  side = ('encoder', 'decoder').index(path[0])
  if not path[1].startswith('layer_'):  # embeddings come before the layers
    return side, -1, 0, list(_AXES).index(path[-1])
  return (side, int(path[1].removeprefix('layer_')), _BLOCKS.index(path[2]),
          list(_AXES).index(path[-1]))


def tensor_tour(config: TransformerConfig, params, batch: Batch) -> list[Stop]:
  """Every named tensor of the teacher-forced forward pass, in forward order.

  Args:
    config: the model's config.
    params: its parameters; None for shapes only (jax.eval_shape: nothing is
      computed or allocated, so even the big model's tour is instant).
    batch: the Batch to run (src [batch, src_len], tgt_in [batch, tgt_len]).

  Returns:
    The Stops: the batch's src, tgt_in, src_mask and tgt_mask; then for the
    encoder and the decoder their token embeddings, positional encoding and
    sum, and per layer each attention block's query/key/value/scores/weights/
    heads/concatenated/output, the feed-forward block's hidden (relu) layer
    and output, and each Add & Norm's output; then the logits.
  """
  def forward(params, batch):
    return Transformer(config).apply(
        {'params': params}, batch.src, batch.tgt_in, batch.src_mask,
        batch.tgt_mask, mutable=['intermediates'])

  if params is None:
    logits, state = jax.eval_shape(lambda b: forward(
        init_params(config, jax.random.key(0)), b), batch)
    as_value = lambda x: x
  else:
    logits, state = jax.jit(forward)(params, batch)
    as_value = np.asarray
  stops = [
      Stop('batch/src', '[batch, src_len]', np.asarray(batch.src)),
      Stop('batch/tgt_in', '[batch, tgt_len]', np.asarray(batch.tgt_in)),
      Stop('batch/tgt_out', '[batch, tgt_len]', np.asarray(batch.tgt_out)),
      Stop('batch/src_mask', '[batch, 1, 1, src_len]',
           np.asarray(batch.src_mask)),
      Stop('batch/tgt_mask', '[batch, 1, tgt_len, tgt_len]',
           np.asarray(batch.tgt_mask)),
  ]
  flat = flax.traverse_util.flatten_dict(
      flax.core.unfreeze(state['intermediates']))
  named = {path: value for path, (value,) in flat.items()}
  for path in sorted(named, key=_forward_order):
    stops.append(Stop('/'.join(path), _axes(path), as_value(named[path])))
  stops.append(Stop('logits', '[batch, tgt_len, vocab]', as_value(logits)))
  return stops


def tour_table(stops: list[Stop], with_values: bool = False) -> str:
  """The tour as a printable table (name, shape, axes), values optional."""
  width = max(len(s.name) for s in stops)
  lines = [f'{"tensor":<{width}}  {"shape":<16}  axes']
  for stop in stops:
    lines.append(f'{stop.name:<{width}}  {str(stop.shape):<16}  {stop.axes}')
    if with_values:
      lines.append(np.array2string(stop.value, precision=3,
                                   suppress_small=True, max_line_width=100))
  return '\n'.join(lines)


def print_tour(config: TransformerConfig, params=None,
               with_values: bool = False) -> None:
  """Prints the tour of the walkthrough batch (random weights where params is None)."""
  if params is None:
    params = init_params(config, jax.random.key(config.seed))
  print(tour_table(tensor_tour(config, params, example_batch(config)),
                   with_values))


def main(argv: list[str] | None = None) -> None:
  parser = cli.OneLineParser(
      prog='python -m flaxformer_mini.tour',
      description='Print every named tensor of one forward pass of the '
      'Transformer on the walkthrough batch (2 pairs, source length 3, '
      'target length 2).')
  parser.add_argument('--config', choices=list(config_lib.PRESETS),
                      default='toy', help='preset, with random weights')
  parser.add_argument('--workdir', help="a run's workdir: its trained model, "
                      'with the config it was trained with')
  parser.add_argument('--values', action='store_true',
                      help="print each tensor's numbers too")
  args = parser.parse_args(argv)
  config, params = config_lib.get_config(args.config), None
  if args.workdir:
    try:
      run = workdir.load_run(args.workdir)
    except (CheckpointError, DataError, workdir.WorkdirError) as e:
      parser.error(str(e))
    config, params = run.config, run.params
  print_tour(config, params, args.values)


if __name__ == '__main__':
  main()
