"""Pictures of a run: training curves, attention heatmaps and Figure 1, live (matplotlib).

Figures are built with `matplotlib.figure.Figure`, not pyplot, so nothing here
touches a global backend: the same functions serve scripts (PNG files) and
notebooks (display the returned figure).

    python -m flaxformer_mini.plots --workdir runs/copy   # -> runs/copy/curves.png
"""

import os

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from flaxformer_mini import cli, logbook, tour
from flaxformer_mini.workdir import BLEU_CURVE, CURVES, METRICS

# Evaluation numbers worth a panel of their own (and its title), in order.
_EVAL_SCORES = {'exact_match': 'exact match (fresh sequences)',
                'val_bleu': 'validation sacreBLEU (greedy)'}


def _log_axis(axis) -> None:
  """A log-scaled y axis whose ticks read as plain numbers (2, not 2 x 10^0)."""
  axis.set_yscale('log')
  axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
  axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f'{value:g}'))
  axis.yaxis.set_minor_formatter(NullFormatter())


def training_curves(workdir: str, title: str | None = None) -> str:
  """Draws WORKDIR/curves.png from WORKDIR/metrics.jsonl; returns its path.

  Panels: training loss (with validation loss where evaluated), learning
  rate, and the evaluation score (copy exact match or validation BLEU) where
  there is one.
  """
  records = logbook.read_records(workdir)
  train = records.get('train', [])
  if not train:
    raise ValueError(f'{workdir} has no logged training steps in '
                     f'{METRICS}; train first.')
  evals = records.get('eval', [])
  scores = [name for name in _EVAL_SCORES if any(name in e for e in evals)]
  figure = Figure(figsize=(4.2 * (2 + len(scores)), 3.4), layout='constrained')
  axes = figure.subplots(1, 2 + len(scores), squeeze=False)[0]
  axes[0].plot(*_series(train, 'loss'), label='training')
  if any('val_loss' in e for e in evals):
    axes[0].plot(*_series(evals, 'val_loss'), 'o-', label='validation')
  axes[0].set(title='loss per target token', xlabel='step')
  _log_axis(axes[0])
  axes[0].legend()
  axes[1].plot(*_series(train, 'learning_rate'))
  axes[1].set(title='learning rate (Noam)', xlabel='step')
  for axis, name in zip(axes[2:], scores):
    axis.plot(*_series(evals, name), 'o-')
    axis.set(title=_EVAL_SCORES[name], xlabel='step')
  if title:
    figure.suptitle(title)
  path = os.path.join(workdir, CURVES)
  figure.savefig(path, dpi=110)
  return path


def _series(rows, name, x='step'):
  rows = [r for r in rows if r.get(name) is not None and x in r]
  return [r[x] for r in rows], [r[name] for r in rows]


def bleu_over_time(workdir: str) -> str:
  """Draws WORKDIR/bleu.png: validation BLEU against wall-clock minutes.

  The minutes count from the start of the run (data preparation included);
  returns the path.
  """
  evals = logbook.read_records(workdir).get('eval', [])
  figure = Figure(figsize=(5.5, 3.6), layout='constrained')
  axis = figure.subplots()
  for name, label in (('val_bleu', 'cased'),
                      ('val_bleu_lowercase', 'lowercased')):
    axis.plot(*_series(evals, name, x='wall_minutes'), 'o-', label=label)
  axis.set(title='validation sacreBLEU (greedy) against time',
           xlabel='minutes since the run started', ylabel='BLEU')
  axis.grid(alpha=0.3)
  axis.legend()
  path = os.path.join(workdir, BLEU_CURVE)
  figure.savefig(path, dpi=110)
  return path


def attention_heatmaps(weights: np.ndarray, query_tokens: list[str],
                       key_tokens: list[str], title: str = '',
                       query_axis: str = 'query', key_axis: str = 'key',
                       row_names: list[str] | None = None) -> Figure:
  """One heatmap per (layer, head) of one sentence's attention weights.

  Args:
    weights: float32[layers, heads, q_len, k_len] attention probabilities
      (each row sums to 1 over the keys).
    query_tokens: q_len labels for the rows (who is looking).
    key_tokens: k_len labels for the columns (what is looked at).
    title: the figure's title.
    query_axis, key_axis: what the rows and the columns are.
    row_names: a name for each row of the grid ('layer 0', ... by default),
      e.g. two models' same layer side by side.

  Returns:
    A matplotlib Figure with a layers x heads grid and one colorbar.
  """
  weights = np.asarray(weights)
  layers, heads, q_len, k_len = weights.shape
  row_names = row_names or [f'layer {layer}' for layer in range(layers)]
  if (q_len, k_len) != (len(query_tokens), len(key_tokens)):
    raise ValueError(f'weights are [{q_len}, {k_len}] per head but there are '
                     f'{len(query_tokens)} query and {len(key_tokens)} key '
                     'labels')
  cell = 0.3
  figure = Figure(figsize=(max(3.5, heads * (k_len * cell + 1.0) + 1.0),
                           max(2.8, layers * (q_len * cell + 1.0))),
                  layout='constrained')
  axes = figure.subplots(layers, heads, squeeze=False)
  for layer in range(layers):
    for head in range(heads):
      axis = axes[layer, head]
      image = axis.imshow(weights[layer, head], vmin=0, vmax=1,
                          cmap='viridis')
      axis.set_xticks(range(k_len), key_tokens, rotation=90, fontsize=7)
      axis.set_yticks(range(q_len), query_tokens, fontsize=7)
      axis.set_title(f'{row_names[layer]}, head {head}', fontsize=8)
      if layer == layers - 1:
        axis.set_xlabel(key_axis, fontsize=8)
      if head == 0:
        axis.set_ylabel(query_axis, fontsize=8)
  figure.colorbar(image, ax=axes, shrink=0.8, label='attention weight')
  if title:
    figure.suptitle(title)
  return figure


ATTENTION_KINDS = (('encoder', 'self_attention'), ('decoder', 'self_attention'),
                   ('decoder', 'cross_attention'))


def model_attention(config, params, batch, source_labels: list[str],
                    target_labels: list[str], item: int = 0) -> dict:
  """The three kinds of attention of a model on one item of a batch.

  Args:
    config, params: the (trained) model.
    batch: a masks.Batch; its item `item` is drawn.
    source_labels: one label per source position (src_len of them).
    target_labels: one label per decoder input position (tgt_in's length).
    item: which row of the batch.

  Returns:
    {'encoder self_attention' | 'decoder self_attention' |
     'decoder cross_attention': Figure}, layers x heads each.
  """
  weights = {stop.name: stop.value for stop in
             tour.tensor_tour(config, params, batch)
             if stop.name.endswith('/weights')}
  labels = {'encoder': source_labels, 'decoder': target_labels}
  axis_names = {'encoder': 'source position', 'decoder': 'decoder input'}
  figures = {}
  for side, block in ATTENTION_KINDS:
    layers = (config.num_encoder_layers if side == 'encoder' else
              config.num_decoder_layers)
    stacked = np.stack([weights[f'{side}/layer_{layer}/{block}/weights'][item]
                        for layer in range(layers)])
    key_side = 'encoder' if block == 'cross_attention' else side
    figures[f'{side} {block}'] = attention_heatmaps(
        stacked, labels[side], labels[key_side], f'{side} {block}',
        f'{axis_names[side]} (query)', f'{axis_names[key_side]} (key)')
  return figures


def _shape(stops: dict, name: str) -> str:
  return f'{name.split("/")[-1]} {list(stops[name].shape)}'


def figure_one(stops: list, config) -> Figure:
  """The paper's Figure 1, each arrow labelled with the live tensor it carries.

  Args:
    stops: the tour of one forward pass (`tour.tensor_tour`), of any model.
    config: that model's config (for the number of layers).

  Returns:
    A matplotlib Figure: the encoder stack on the left, the decoder on the
    right, one layer of each drawn (the N x box), every arrow named by the
    tour's stop it carries, with its shape, e.g. 'embedded [2, 3, 8]'; each
    attention block gets its three arrows, query, key and value.
  """
  stops = {stop.name: stop for stop in stops}
  figure = Figure(figsize=(11, 12.5), layout='constrained')
  axis = figure.subplots()
  axis.set(xlim=(0, 13), ylim=(-0.6, 17.3))
  axis.axis('off')
  colours = {'attention': '#f9d9a6', 'norm': '#f3f3b0', 'feed': '#bfe3f2',
             'embed': '#f6c6c6', 'out': '#d9cdf0'}
  blue, red = '#1f4e99', '#b03030'

  def box(x, y, text, kind):
    axis.text(x, y, text, ha='center', va='center', fontsize=9, zorder=3,
              bbox={'boxstyle': 'round,pad=0.4', 'fc': colours[kind], 'ec': 'black', 'lw': 0.8})

  def arrow(x0, y0, x1, y1, colour='black'):
    axis.annotate('', (x1, y1), (x0, y0), zorder=2,
                  arrowprops={'arrowstyle': '->', 'lw': 1.0, 'color': colour,
                              'shrinkA': 0, 'shrinkB': 0})

  def label(x, y, text, colour=blue, side='left'):
    axis.text(x, y, text, fontsize=7, ha=side, va='center', color=colour, zorder=4)

  def flow(x, y0, y1, name=None):  # box to box, labelled with the stop it carries
    arrow(x, y0 + 0.45, x, y1 - 0.45)
    if name:
      label(x + 0.12, (y0 + y1) / 2, _shape(stops, name))

  def three_arrows(x, y, block, sources, offsets=(-0.7, 0.0, 0.7)):
    """The query, key and value arrows into the attention box at (x, y)."""
    for dx, name, (x0, y0) in zip(offsets, ('query', 'key', 'value'), sources):
      axis.plot([x0, x + dx], [y0, y - 1.0], color='black', lw=1.0, zorder=2)
      arrow(x + dx, y - 1.0, x + dx, y - 0.5)
      axis.text(x + dx - 0.08, y - 0.75, name[0].upper(), fontsize=7, ha='right', va='center')
    label(x + 1.35, y, '\n'.join(_shape(stops, f'{block}/{n}')
                                  for n in ('query', 'key', 'value')))

  def inputs(x, side, title, ids, table):
    axis.text(x, -0.2, title, ha='center', va='top', fontsize=9)
    arrow(x, -0.15, x, 1.15)
    label(x + 0.12, 0.5, _shape(stops, ids))
    box(x, 1.6, f'{side.capitalize() if side == "input" else "Output"}\nEmbedding', 'embed')
    flow(x, 1.6, 3.0, f'{table.split("/")[0]}/token_embedding')
    axis.text(x, 3.0, '+', ha='center', va='center', fontsize=13, zorder=3,
              bbox={'boxstyle': 'circle,pad=0.1', 'fc': 'white', 'ec': 'black'})
    axis.text(x - 0.4, 3.0, 'Positional Encoding\n' + _shape(stops, table),
              ha='right', va='center', fontsize=7)
    axis.plot([x, x], [3.3, 4.2], color='black', lw=1.0)
    label(x + 0.12, 3.75, _shape(stops, f'{table.split("/")[0]}/embedded'))

  def sublayer(x, y, title, kind, output=None):
    """A sublayer's box at height y, its output's arrow, Add & Norm above it."""
    box(x, y, title, kind)
    flow(x, y, y + 1.5, output)
    box(x, y + 1.5, 'Add & Norm', 'norm')

  def stack(x, bottom, top, layers):
    axis.add_patch(FancyBboxPatch((x - 1.9, bottom), 3.8, top - bottom, zorder=1,
                                  boxstyle='round,pad=0.1', fc='#f2f2f2', ec='gray'))
    axis.text(x - 2.05, (bottom + top) / 2, f'{layers}x', ha='right', va='center', fontsize=11)

  enc, dec = 3.0, 9.4
  # The encoder (left).
  inputs(enc, 'input', 'Inputs', 'batch/src', 'encoder/positional_encoding/table')
  stack(enc, 3.95, 10.3, config.num_encoder_layers)
  three_arrows(enc, 5.4, 'encoder/layer_0/self_attention', [(enc, 4.2)] * 3)
  sublayer(enc, 5.4, 'Multi-Head\nAttention', 'attention', 'encoder/layer_0/self_attention/output')
  flow(enc, 6.9, 8.3, 'encoder/layer_0/after_self_attention')
  sublayer(enc, 8.3, 'Feed\nForward', 'feed')
  encoded = f'encoder/layer_{config.num_encoder_layers - 1}/after_feed_forward'
  # The encoder's output: keys and values of every decoder layer's second block.
  axis.plot([enc, enc, dec - 1.6, dec - 1.6], [10.15, 11.2, 11.2, 7.7], color=red, lw=1.2)
  axis.plot([dec - 1.6, dec - 0.7], [7.7, 7.7], color=red, lw=1.2)
  axis.text((enc + dec) / 2 - 0.8, 11.4, f'the encoder output, {_shape(stops, encoded)}',
            ha='center', fontsize=7, color=red)
  # The decoder (right).
  inputs(dec, 'output', 'Outputs\n(shifted right)', 'batch/tgt_in',
         'decoder/positional_encoding/table')
  stack(dec, 3.95, 14.1, config.num_decoder_layers)
  three_arrows(dec, 5.4, 'decoder/layer_0/self_attention', [(dec, 4.2)] * 3)
  sublayer(dec, 5.4, 'Masked\nMulti-Head\nAttention', 'attention',
           'decoder/layer_0/self_attention/output')
  axis.plot([dec, dec], [7.35, 7.7], color='black', lw=1.0)
  label(dec + 1.35, 7.6, _shape(stops, 'decoder/layer_0/after_self_attention'))
  three_arrows(dec, 8.9, 'decoder/layer_0/cross_attention',
               [(dec, 7.7), (dec - 0.7, 7.7), (dec - 0.7, 7.7)], offsets=(0.7, -0.7, 0.0))
  sublayer(dec, 8.9, 'Multi-Head\nAttention', 'attention', 'decoder/layer_0/cross_attention/output')
  flow(dec, 10.4, 11.9, 'decoder/layer_0/after_cross_attention')
  sublayer(dec, 11.9, 'Feed\nForward', 'feed')
  flow(dec, 13.4, 15.0, f'decoder/layer_{config.num_decoder_layers - 1}/after_feed_forward')
  box(dec, 15.0, 'Linear', 'out')
  flow(dec, 15.0, 16.2, 'logits')
  box(dec, 16.2, 'Softmax', 'out')
  axis.text(dec, 17.0, 'Output Probabilities', ha='center', fontsize=9)
  figure.suptitle(f'Figure 1, live: d_model {config.d_model}, {config.num_heads} heads, '
                  f'{config.num_encoder_layers} + {config.num_decoder_layers} layers (one of '
                  'each stack drawn), the shapes of this batch', fontsize=10)
  return figure


def main(argv: list[str] | None = None) -> None:
  parser = cli.OneLineParser(
      prog='python -m flaxformer_mini.plots',
      description=f"Draw WORKDIR/{CURVES} from a run's {METRICS}.")
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--title')
  args = parser.parse_args(argv)
  try:
    print(training_curves(args.workdir, args.title))
  except ValueError as e:
    parser.error(str(e))


if __name__ == '__main__':
  main()
