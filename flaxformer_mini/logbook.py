"""The run's logbook: every logged number, on disk, as JSON lines and TensorBoard.

Training appends one record per log (step, loss, accuracy, learning rate,
tokens/s) and one per evaluation (exact match, validation loss, BLEU, ...) to
WORKDIR/metrics.jsonl and to TensorBoard event files in WORKDIR/tensorboard.
A resumed run continues the same file: opening the logbook at step S drops
the records past S, which the run is about to compute again.
`flaxformer_mini.plots.training_curves` draws WORKDIR/curves.png from them.

    tensorboard --logdir WORKDIR/tensorboard
"""

import json
import os
import sys

from tensorboardX import SummaryWriter

from flaxformer_mini.workdir import METRICS, TENSORBOARD, WorkdirError


class Logbook:
  """Appends records {'step': int, 'kind': 'train'|'eval', name: float, ...}."""

  def __init__(self, workdir: str, start_step: int = 0):
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, METRICS)
    kept = [json.dumps(r) + '\n' for r in _load(path) if r['step'] <= start_step]
    with open(path, 'w') as f:
      f.writelines(kept)
    self._records = open(path, 'a')
    self._tensorboard = SummaryWriter(os.path.join(workdir, TENSORBOARD))

  def write(self, kind: str, record: dict) -> None:
    """Logs the scalar values of `record` (which holds 'step') under `kind`."""
    step = int(record['step'])
    self._records.write(json.dumps({'kind': kind, **record}) + '\n')
    self._records.flush()  # a killed run keeps every record it logged
    for name, value in record.items():
      if name != 'step' and value is not None:
        self._tensorboard.add_scalar(f'{kind}/{name}', value, step)
    self._tensorboard.flush()

  def close(self) -> None:
    self._records.close()
    self._tensorboard.close()


def _load(path: str) -> list[dict]:
  """The records of `path`. A last line cut short (a crash or a full disk
  mid-write: the file is only ever appended to) is dropped with a warning;
  a damaged line before it is a WorkdirError naming it."""
  if not os.path.isfile(path):
    return []
  with open(path, encoding='utf-8', errors='replace') as f:
    lines = [(number, line) for number, line in enumerate(f, start=1)
             if line.strip()]
  records = []
  for number, line in lines:
    try:
      records.append(json.loads(line))
    except ValueError:
      if number != lines[-1][0]:
        raise WorkdirError(
            f'{path}: line {number} is damaged; restore the file from a copy, '
            'or move it away to start the log afresh.') from None
      print(f'warning: {path}: its last line was cut short (a crash or a '
            'full disk); dropping it.', file=sys.stderr)
  return records


def read_records(workdir: str) -> dict[str, list[dict]]:
  """{kind: [record, ...] in step order} from WORKDIR/metrics.jsonl."""
  kinds = {}
  for record in _load(os.path.join(workdir, METRICS)):
    kinds.setdefault(record.pop('kind'), []).append(record)
  return kinds
