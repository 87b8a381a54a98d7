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


class _Drawing:
  """The boxes, arrows and labels of Figure 1 on one matplotlib axis.

  Labels name the tour's stops; a stop the drawn model lacks (a variant
  without it) is labelled as such, never looked up blindly.
  """
  COLOURS = {'attention': '#f9d9a6', 'norm': '#f3f3b0', 'feed': '#bfe3f2',
             'embed': '#f6c6c6', 'out': '#d9cdf0'}
  BLUE, RED, GREEN = '#1f4e99', '#b03030', '#2e7d32'

  def __init__(self, axis, stops: dict):
    self.axis, self.stops = axis, stops

  def shape(self, name: str) -> str:
    """'embedded [2, 3, 8]': a stop's short name and shape."""
    short = name.split('/')[-1]
    if name not in self.stops:
      return f'{short} (not in this model)'
    return f'{short} {list(self.stops[name].shape)}'

  def box(self, x, y, text, kind):
    self.axis.text(x, y, text, ha='center', va='center', fontsize=9, zorder=3,
                   bbox={'boxstyle': 'round,pad=0.4', 'fc': self.COLOURS[kind],
                         'ec': 'black', 'lw': 0.8})

  def arrow(self, x0, y0, x1, y1, colour='black'):
    self.axis.annotate('', (x1, y1), (x0, y0), zorder=2,
                       arrowprops={'arrowstyle': '->', 'lw': 1.0,
                                   'color': colour, 'shrinkA': 0,
                                   'shrinkB': 0})

  def line(self, xs, ys, colour='black', width=1.0):
    self.axis.plot(xs, ys, color=colour, lw=width, zorder=2)

  def label(self, x, y, text, colour=BLUE, side='left'):
    self.axis.text(x, y, text, fontsize=7, ha=side, va='center',
                   color=colour, zorder=4)

  def flow(self, x, y0, y1, name=None):
    """An arrow from the box at y0 to the box at y1, labelled with its stop."""
    self.arrow(x, y0 + 0.45, x, y1 - 0.45)
    if name:
      self.label(x + 0.12, (y0 + y1) / 2, self.shape(name))

  def three_arrows(self, x, y, block, sources, offsets=(-0.7, 0.0, 0.7)):
    """The query, key and value arrows into the attention box at (x, y)."""
    for dx, name, (x0, y0) in zip(offsets, ('query', 'key', 'value'),
                                  sources):
      self.line([x0, x + dx], [y0, y - 1.0])
      self.arrow(x + dx, y - 1.0, x + dx, y - 0.5)
      self.axis.text(x + dx - 0.08, y - 0.75, name[0].upper(), fontsize=7,
                     ha='right', va='center')
    self.label(x + 1.35, y, '\n'.join(self.shape(f'{block}/{n}')
                                      for n in ('query', 'key', 'value')))

  def inputs(self, x, side: str, title: str, ids: str):
    """Ids -> embedding (+ positional encoding, where the model adds one)."""
    self.axis.text(x, -0.2, title, ha='center', va='top', fontsize=9)
    self.arrow(x, -0.15, x, 1.15)
    self.label(x + 0.12, 0.5, self.shape(ids))
    self.box(x, 1.6, ('Input' if side == 'encoder' else 'Output') +
             '\nEmbedding', 'embed')
    self.flow(x, 1.6, 3.0, f'{side}/token_embedding')
    encoding = f'{side}/positional_encoding/encoding'
    if encoding in self.stops:
      self.axis.text(x, 3.0, '+', ha='center', va='center', fontsize=13,
                     zorder=3, bbox={'boxstyle': 'circle,pad=0.1',
                                     'fc': 'white', 'ec': 'black'})
      self.axis.text(x - 0.4, 3.0, 'Positional Encoding\n' +
                     self.shape(encoding), ha='right', va='center',
                     fontsize=7)
    self.line([x, x], [3.3, 4.2])
    self.label(x + 0.12, 3.75, self.shape(f'{side}/embedded'))

  def sublayer(self, x, y, title, kind, output=None, residual=None,
               side=-1):
    """A sublayer's box at height y, its output's arrow, Add & Norm above
    it, and the residual arrow from below the box (`residual`: the stop
    that carries the sublayer's input) around its left (side -1) or right
    (+1) into Add & Norm."""
    self.box(x, y, title, kind)
    self.flow(x, y, y + 1.5, output)
    self.box(x, y + 1.5, 'Add & Norm', 'norm')
    if residual:
      edge = x + (1.6 if side < 0 else 1.15) * side
      self.line([x, edge, edge], [y - 1.05, y - 1.05, y + 1.5], self.GREEN,
                0.9)
      self.arrow(edge, y + 1.5, x + side * 0.75, y + 1.5, self.GREEN)
      self.label(edge + side * 0.08, y + 1.0, 'residual\n' +
                 self.shape(residual), self.GREEN,
                 side='right' if side < 0 else 'left')

  def stack(self, x, bottom, top, layers):
    self.axis.add_patch(FancyBboxPatch(
        (x - 1.9, bottom), 3.8, top - bottom, zorder=1,
        boxstyle='round,pad=0.1', fc='#f2f2f2', ec='gray'))
    self.axis.text(x - 2.05, (bottom + top) / 2, f'{layers}x', ha='right',
                   va='center', fontsize=11)


def _draw_encoder(draw: _Drawing, x: float, layers: int) -> None:
  """The left half: inputs, one encoder layer inside the N x box."""
  draw.inputs(x, 'encoder', 'Inputs', 'batch/src')
  draw.stack(x, 3.95, 10.3, layers)
  block = 'encoder/layer_0'
  draw.three_arrows(x, 5.4, f'{block}/self_attention', [(x, 4.2)] * 3)
  draw.sublayer(x, 5.4, 'Multi-Head\nAttention', 'attention',
                f'{block}/self_attention/output', 'encoder/embedded')
  draw.flow(x, 6.9, 8.3, f'{block}/after_self_attention')
  draw.sublayer(x, 8.3, 'Feed\nForward', 'feed',
                f'{block}/feed_forward/output',
                f'{block}/after_self_attention')


def _draw_decoder(draw: _Drawing, x: float, layers: int) -> None:
  """The right half: outputs, one decoder layer, the linear and softmax."""
  draw.inputs(x, 'decoder', 'Outputs\n(shifted right)', 'batch/tgt_in')
  draw.stack(x, 3.95, 14.1, layers)
  block = 'decoder/layer_0'
  draw.three_arrows(x, 5.4, f'{block}/self_attention', [(x, 4.2)] * 3)
  draw.sublayer(x, 5.4, 'Masked\nMulti-Head\nAttention', 'attention',
                f'{block}/self_attention/output', 'decoder/embedded')
  draw.line([x, x], [7.35, 7.7])
  draw.label(x + 1.35, 7.6, draw.shape(f'{block}/after_self_attention'))
  draw.three_arrows(x, 8.9, f'{block}/cross_attention',
                    [(x, 7.7), (x - 0.7, 7.7), (x - 0.7, 7.7)],
                    offsets=(0.7, -0.7, 0.0))
  draw.sublayer(x, 8.9, 'Multi-Head\nAttention', 'attention',
                f'{block}/cross_attention/output',
                f'{block}/after_self_attention', side=1)
  draw.flow(x, 10.4, 11.9, f'{block}/after_cross_attention')
  draw.sublayer(x, 11.9, 'Feed\nForward', 'feed',
                f'{block}/feed_forward/output',
                f'{block}/after_cross_attention')
  draw.flow(x, 13.4, 15.0, f'decoder/layer_{layers - 1}/after_feed_forward')
  draw.box(x, 15.0, 'Linear', 'out')
  draw.flow(x, 15.0, 16.2, 'logits')
  draw.box(x, 16.2, 'Softmax', 'out')
  draw.line([x, x], [16.65, 16.85])
  # Not a stop: the model returns logits; softmax(logits) has their shape.
  draw.label(x + 0.12, 16.75, 'softmax(logits) ' +
             draw.shape('logits').split(' ', 1)[1])
  draw.axis.text(x, 17.0, 'Output Probabilities', ha='center', fontsize=9)


def figure_one(stops: list, config) -> Figure:
  """The paper's Figure 1, each arrow labelled with the live tensor it carries.

  Args:
    stops: the tour of one forward pass (`tour.tensor_tour`), of any model.
    config: that model's config (for the number of layers).

  Returns:
    A matplotlib Figure: the encoder stack on the left, the decoder on the
    right, one layer of each drawn (the N x box), every arrow named by the
    tour's stop it carries, with its shape, e.g. 'embedded [2, 3, 8]'; each
    attention block gets its three arrows, query, key and value, and each
    Add & Norm its residual arrow. A stop the model lacks is labelled
    '(not in this model)'.
  """
  stops = {stop.name: stop for stop in stops}
  figure = Figure(figsize=(11, 12.5), layout='constrained')
  axis = figure.subplots()
  axis.set(xlim=(-0.5, 13.5), ylim=(-0.6, 17.3))
  axis.axis('off')
  draw = _Drawing(axis, stops)
  enc, dec = 3.0, 9.4
  _draw_encoder(draw, enc, config.num_encoder_layers)
  # The encoder's output: keys and values of every decoder layer's second
  # block (the cross-attention's residual is its own query side).
  encoded = f'encoder/layer_{config.num_encoder_layers - 1}/after_feed_forward'
  draw.line([enc, enc, dec - 1.6, dec - 1.6], [10.15, 11.2, 11.2, 7.7],
            draw.RED, 1.2)
  draw.line([dec - 1.6, dec - 0.7], [7.7, 7.7], draw.RED, 1.2)
  axis.text((enc + dec) / 2 - 0.8, 11.4,
            f'the encoder output, {draw.shape(encoded)}', ha='center',
            fontsize=7, color=draw.RED)
  _draw_decoder(draw, dec, config.num_decoder_layers)
  figure.suptitle(
      f'Figure 1, live: d_model {config.d_model}, {config.num_heads} heads, '
      f'{config.num_encoder_layers} + {config.num_decoder_layers} layers (one '
      'of each stack drawn), the shapes of this batch', fontsize=10)
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
