"""The command line: flags -> config -> a run.

  python train.py --task=copy                      # the copy task, copy preset
  python train.py --task=copy --d_model=32 --pre_norm=true
  python train.py --task=translate --data_dir=DIR  # e.g. Multi30k task 1
  python train.py --help                           # every config field

Bad flags, data or workdirs end in a one-line error that names the flag,
file or folder and what to do, before JAX compiles anything.
"""

import argparse
import dataclasses
import os
import sys
import time
import typing

_START = time.perf_counter()

from flaxformer_mini import cli, compilation_cache  # pylint: disable=g-import-not-at-top
from flaxformer_mini import config as config_lib  # pylint: disable=g-import-not-at-top
from flaxformer_mini.tasks import TASKS  # pylint: disable=g-import-not-at-top


def _field_types() -> dict[str, type]:
  hints = typing.get_type_hints(config_lib.TransformerConfig)
  return {f.name: hints[f.name]
          for f in dataclasses.fields(config_lib.TransformerConfig)}


def _field_help(field: dataclasses.Field) -> str:
  differing = ', '.join(f'{name}={getattr(preset, field.name)}'
                        for name, preset in config_lib.PRESETS.items()
                        if getattr(preset, field.name) != field.default)
  allowed = config_lib.CHOICES.get(field.name)
  return ((f'one of {", ".join(allowed)}; ' if allowed else '') +
          f'default {field.default}' +
          (f' ({differing})' if differing else ''))


def build_parser() -> cli.OneLineParser:
  parser = cli.OneLineParser(
      prog='train.py', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--task', choices=list(TASKS), required=True,
                      help='what to train: ' + '; '.join(
                          f'{name}: {task.description}'
                          for name, task in TASKS.items()) + '.')
  parser.add_argument('--config', choices=list(config_lib.PRESETS),
                      help="the preset to start from (default: the task's "
                      'own: ' + ', '.join(
                          f'{task.preset} for --task={name}'
                          for name, task in TASKS.items()) + ').')
  parser.add_argument('--workdir', help='where results.json and the '
                      'checkpoints go (default: runs/<task>); a workdir with '
                      'checkpoints is resumed.')
  data = parser.add_argument_group(
      'translation data', 'one of --data_dir (local files, e.g. Multi30k) or '
      '--dataset (a prepared TFDS catalog dataset).')
  data.add_argument('--data_dir', help='folder of train.{lang}[.gz], '
                    'val.{lang}[.gz], test*.{lang}[.gz] files.')
  data.add_argument('--dataset', help='TFDS name, e.g. wmt14_translate/de-en.')
  data.add_argument('--tfds_dir', help="TFDS data dir (default: "
                    "WORKDIR/tfds for local files, TFDS's own otherwise).")
  compilation_cache.add_flag(parser)
  parser.add_argument('--tour', action='store_true',
                      help='print every named tensor of one forward pass on '
                      'a batch of 2 (shapes and axes) and exit, without '
                      "training: the trained model of --workdir (with its "
                      'own config), or random weights of the preset.')
  parser.add_argument('--fresh', action='store_true',
                      help="set everything the workdir's earlier run wrote "
                      'aside (into WORKDIR/set-aside-<time>) and start over '
                      'instead of resuming.')
  hosts = parser.add_argument_group(
      'multi-host', 'start one process per host; on Cloud TPU pods and '
      'SLURM / Kubernetes GPU clusters --multihost alone finds the others.')
  hosts.add_argument('--multihost', action='store_true',
                     help="join JAX's multi-controller runtime.")
  hosts.add_argument('--coordinator_address',
                     help='host:port of process 0 (implies --multihost).')
  hosts.add_argument('--num_processes', type=int,
                     help='how many processes in all.')
  hosts.add_argument('--process_id', type=int, help="this process's index.")
  hosts.add_argument('--multihost_timeout', type=int, default=300,
                     help='seconds to wait for every process (default '
                     '%(default)s).')
  fields = parser.add_argument_group(
      'config fields', 'override any field of the preset; defaults are the '
      'dataclass defaults, with the presets that differ in parentheses.')
  for field in dataclasses.fields(config_lib.TransformerConfig):
    fields.add_argument(f'--{field.name}', default=argparse.SUPPRESS,
                        metavar=_field_types()[field.name].__name__,
                        help=_field_help(field))
  return parser


def _parse_value(name: str, kind: type, text: str):
  if kind is bool:
    lowered = text.strip().lower()
    if lowered in ('1', 'true', 'yes'):
      return True
    if lowered in ('0', 'false', 'no'):
      return False
    raise config_lib.ConfigError(f'{name}={text}: allowed values: true, false.')
  try:
    return kind(text)
  except ValueError:
    raise config_lib.ConfigError(
        f'{name}={text}: expected a value of type {kind.__name__}.') from None


def override(config: config_lib.TransformerConfig,
             overrides: dict[str, str]) -> config_lib.TransformerConfig:
  """Applies command-line strings {field: text} to `config`, validating them.

  Raises:
    ConfigError: naming the field with the bad value.
  """
  types = _field_types()
  parsed = {name: _parse_value(name, types[name], text)
            for name, text in overrides.items()}
  return config.replace(**parsed)


def parse(argv: list[str]):
  """argv -> (args, config); exits with a one-line error on bad input."""
  parser = build_parser()
  args, unknown = parser.parse_known_args(argv)
  if unknown:
    flag = unknown[0].split('=')[0]
    parser.error(f'{flag}: unknown flag; allowed: --task, --config, '
                 '--workdir, --fresh, --tour, --compilation_cache, the data '
                 'and multi-host flags, or a config field (see --help).')
  overrides = {k: v for k, v in vars(args).items() if k in _field_types()}
  try:
    config = override(
        config_lib.get_config(args.config or TASKS[args.task].preset),
        overrides)
  except config_lib.ConfigError as e:
    parser.error(f'--{e}')
  if not (args.multihost or args.coordinator_address):
    given = [f'--{name}' for name in ('num_processes', 'process_id')
             if getattr(args, name) is not None]
    if given:
      parser.error(f'{" and ".join(given)} without --multihost or '
                   '--coordinator_address would train as one process; add '
                   'one of them, or drop the flag.')
  if TASKS[args.task].reads_text and not args.tour:
    if not args.data_dir and not args.dataset:
      parser.error(f'--task={args.task} needs --data_dir (local files) or '
                   '--dataset (a TFDS name).')
    if args.data_dir and args.dataset:
      parser.error('--data_dir and --dataset: give one of them.')
    if args.data_dir and not os.path.isdir(args.data_dir):
      parser.error(f'--data_dir={args.data_dir}: no such directory.')
  return args, config


def _tour(args, config) -> None:
  """--tour: the workdir's trained model with its own config, or the preset."""
  # pylint: disable=g-import-not-at-top
  from flaxformer_mini import tour, workdir
  if args.workdir:
    run = workdir.load_run(args.workdir)
    config, params = run.config, run.params
    print(f'the trained model of {args.workdir}')
  else:
    params = None
    print(f'random weights of the {args.config or TASKS[args.task].preset} '
          'preset (give --workdir for a trained model)')
  tour.print_tour(config, params)


def main(argv: list[str]) -> None:
  args, config = parse(argv)
  path = args.workdir or os.path.join('runs', args.task)
  multi = args.multihost or args.coordinator_address
  # pylint: disable=g-import-not-at-top
  from flaxformer_mini import multihost
  if multi and not os.environ.get(multihost.SUPERVISED):
    sys.exit(multihost.supervise(
        [os.path.abspath(__file__), *argv],
        lambda said: _unjoined_line(args.multihost_timeout)
        if multihost.never_joined(said) else _lost_peer_line(
            path, said, args.process_id, args.num_processes)))
  compilation_cache.use(args.compilation_cache)
  from flaxformer_mini import checkpoints, disk, loop, run, workdir
  from flaxformer_mini.data import DataError
  try:
    if args.tour:
      _tour(args, config)
      return
    if multi:
      multihost.initialize(args.coordinator_address, args.num_processes,
                           args.process_id, args.multihost_timeout)
    task, data = TASKS[args.task], {}
    if task.reads_text:
      if missing := cli.missing_translation_extras():
        sys.exit(f'train.py: error: {missing}')
      data = {'data_dir': args.data_dir, 'dataset': args.dataset,
              'tfds_dir': args.tfds_dir}
    task.run(config, path, fresh=args.fresh, start_time=_START, **data)
  except config_lib.ConfigError as e:
    build_parser().error(f'--{e}')
  except (checkpoints.CheckpointError, DataError, workdir.WorkdirError,
          multihost.MultihostError, disk.DiskFull) as e:
    sys.exit(f'train.py: error: {e}')
  except run.NothingToTrain as e:
    print(f'train.py: {e}')
  except loop.NonFinite as e:
    sys.exit(f'train.py: {e}')
  except loop.Interrupted as e:
    print(f'train.py: {e}', file=sys.stderr)
    sys.exit(128 + e.signum)
  except Exception as e:  # pylint: disable=broad-except
    if multihost.lost_peer(e):
      _stop_for_lost_peer(path, str(e))
    if not disk.is_full(e):
      raise
    # Any other writer (the data's preparation, results.json, ...).
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    sys.exit(f'train.py: error: no space left on the disk of {path} '
             f'({first}); free some and run the same command again.')


def _unjoined_line(timeout: int) -> str:
  """The one line of a multi-host run's process whose peers never came."""
  return ('train.py: error: the other processes of this multi-host run did '
          f'not join within --multihost_timeout={timeout} s '
          '(DEADLINE_EXCEEDED); start every process (the same command, each '
          'with its own --process_id), or raise --multihost_timeout.')


def _lost_peer_line(path: str, detail: str, me: int | None,
                    count: int | None) -> str:
  """The one line of a multi-host run's process whose peer stopped."""
  # pylint: disable-next=g-import-not-at-top
  from flaxformer_mini import checkpoints, multihost
  steps = checkpoints.intact_steps(os.path.join(path, 'checkpoints'))
  last = (f'the last checkpoint is step {steps[-1]}' if steps else
          'no checkpoint was saved yet')
  first = (detail.strip().splitlines() or ['lost'])[0][:160]
  this = 'this process' if me is None else f'process {me}'
  return (f'train.py: error: {multihost.stopped_process(detail, me, count)} '
          f'of this multi-host run stopped ({first}), so {this} stops too; '
          f'{last}: start every process again with the same command.')


def _stop_for_lost_peer(path: str, detail: str) -> None:
  """A failed collective: one line, then the end of this process at once
  (JAX's exit would wait for the lost process at its shutdown barrier)."""
  import jax  # pylint: disable=g-import-not-at-top
  line = _lost_peer_line(path, detail, jax.process_index(),
                         jax.process_count())
  os.write(sys.stderr.fileno(), f'\n{line}\n'.encode())
  os._exit(1)  # pylint: disable=protected-access


if __name__ == '__main__':
  main(sys.argv[1:])
