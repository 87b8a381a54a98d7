"""Pictures of a run: training curves and attention heatmaps (matplotlib).

Figures are built with `matplotlib.figure.Figure`, not pyplot, so nothing here
touches a global backend: the same functions serve scripts (PNG files) and
notebooks (display the returned figure).

    python -m flaxformer_mini.plots --workdir runs/copy   # -> runs/copy/curves.png
"""

import os

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
import numpy as np

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
                       query_axis: str = 'query', key_axis: str = 'key'
                       ) -> Figure:
  """One heatmap per (layer, head) of one sentence's attention weights.

  Args:
    weights: float32[layers, heads, q_len, k_len] attention probabilities
      (each row sums to 1 over the keys).
    query_tokens: q_len labels for the rows (who is looking).
    key_tokens: k_len labels for the columns (what is looked at).
    title: the figure's title.
    query_axis, key_axis: what the rows and the columns are.

  Returns:
    A matplotlib Figure with a layers x heads grid and one colorbar.
  """
  weights = np.asarray(weights)
  layers, heads, q_len, k_len = weights.shape
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
      axis.set_title(f'layer {layer}, head {head}', fontsize=8)
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
