"""What train.py trains, one row per task: its preset and the module that
trains it (`run(config, workdir_path, *, fresh, start_time, ...)`).

A new task is a module with that `run` and a row here; train.py reads the
table for its --task choices, the default preset and the dispatch.
"""

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Task:
  """One task: its config preset (where --config is not given), the module
  whose `run` trains it, and whether it reads parallel text (the [translate]
  extra and --data_dir or --dataset)."""
  preset: str
  module: str
  description: str
  reads_text: bool = False

  def run(self, *args, **kwargs) -> dict:
    """The task's module's `run` (imported now: each task imports only what
    it needs, so the copy task runs without TFDS)."""
    return importlib.import_module(self.module).run(*args, **kwargs)


TASKS = {
    'copy': Task('copy', 'flaxformer_mini.tasks.train_copy',
                 'copy random sequences: the one-minute wiring check'),
    'translate': Task('multi30k', 'flaxformer_mini.tasks.train_translation',
                      'translate parallel text', reads_text=True),
}
