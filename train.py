"""The command line: flags -> config -> a run.

  python train.py --task=copy                      # the copy task, copy preset
  python train.py --task=copy --d_model=32 --pre_norm=true
  python train.py --task=translate --data_dir=../shared/data/multi30k
  python train.py --help                           # every config field

Bad flags end in a one-line error that names the flag and what is allowed,
before JAX compiles anything.
"""

import argparse
import dataclasses
import os
import sys
import time

_START = time.perf_counter()

from flaxformer_mini import config as config_lib  # pylint: disable=g-import-not-at-top

TASKS = {'copy': 'copy', 'translate': 'translate'}  # task -> its preset


class OneLineParser(argparse.ArgumentParser):
  """argparse, but an error is one line naming the flag (no usage block)."""

  def error(self, message):
    self.exit(2, f'{self.prog}: error: {message}\n')


def _field_help(field: dataclasses.Field) -> str:
  presets = {name: getattr(make(), field.name)
             for name, make in config_lib.PRESETS.items()}
  differing = ', '.join(f'{name}={value}' for name, value in presets.items()
                        if value != field.default)
  return f'default {field.default}' + (f' ({differing})' if differing else '')


def build_parser() -> OneLineParser:
  parser = OneLineParser(
      prog='train.py', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--task', choices=sorted(TASKS), required=True,
                      help='what to train.')
  parser.add_argument('--config', choices=list(config_lib.PRESETS),
                      help='the preset to start from (default: the task\'s '
                      'own, e.g. copy for --task=copy).')
  parser.add_argument('--workdir', help='where results.json and the '
                      'checkpoints go (default: runs/<task>); a workdir with '
                      'checkpoints is resumed.')
  data = parser.add_argument_group(
      'translation data', 'one of --data_dir (local files, e.g. Multi30k) or '
      '--dataset (a prepared TFDS catalog dataset).')
  data.add_argument('--data_dir', help='folder of train.{lang}[.gz], '
                    'val.{lang}[.gz], test*.{lang}[.gz] files.')
  data.add_argument('--dataset', help='TFDS name, e.g. wmt14_translate/de-en.')
  data.add_argument('--tfds_dir', help='TFDS data dir (default: '
                    'WORKDIR/tfds for local files, TFDS\'s own otherwise).')
  parser.add_argument(
      '--compilation_cache', default=os.environ.get(
          'JAX_COMPILATION_CACHE_DIR', os.path.join(
              os.path.expanduser('~'), '.cache', 'flaxformer_mini', 'xla')),
      help='persistent XLA compilation cache: a rerun loads the compiled '
      'programs instead of compiling them again ("" turns it off; default '
      '%(default)s).')
  parser.add_argument('--tour', action='store_true',
                      help='print every named tensor of one forward pass on '
                      'a batch of 2 (shapes and axes; the trained model of '
                      '--workdir if it has one) and exit, without training.')
  parser.add_argument('--fresh', action='store_true',
                      help='set the workdir\'s checkpoints aside and start '
                      'over instead of resuming.')
  hosts = parser.add_argument_group(
      'multi-host', 'start one process per host; on Cloud TPU pods and '
      'SLURM / Kubernetes GPU clusters --multihost alone finds the others.')
  hosts.add_argument('--multihost', action='store_true',
                     help='join JAX\'s multi-controller runtime.')
  hosts.add_argument('--coordinator_address',
                     help='host:port of process 0 (implies --multihost).')
  hosts.add_argument('--num_processes', type=int,
                     help='how many processes in all.')
  hosts.add_argument('--process_id', type=int, help='this process\'s index.')
  fields = parser.add_argument_group(
      'config fields', 'override any field of the preset; defaults are the '
      'dataclass defaults, with the presets that differ in parentheses.')
  for field in dataclasses.fields(config_lib.TransformerConfig):
    fields.add_argument(f'--{field.name}', default=argparse.SUPPRESS,
                        metavar=field.type.__name__, help=_field_help(field))
  return parser


def parse(argv: list[str]):
  """argv -> (args, config); exits with a one-line error on bad input."""
  parser = build_parser()
  args, unknown = parser.parse_known_args(argv)
  if unknown:
    flag = unknown[0].split('=')[0]
    parser.error(f'{flag}: unknown flag; allowed: --task, --config, '
                 '--workdir, --fresh, --tour, --compilation_cache, the data '
                 'and multi-host flags, or a config field (see --help).')
  field_names = {f.name for f in dataclasses.fields(config_lib.TransformerConfig)}
  overrides = {k: v for k, v in vars(args).items() if k in field_names}
  try:
    config = config_lib.override(
        config_lib.get_config(args.config or TASKS[args.task]), overrides)
  except config_lib.ConfigError as e:
    parser.error(str(e))
  if args.task == 'translate' and bool(args.data_dir) == bool(args.dataset):
    parser.error('--task=translate needs one of --data_dir (local files) or '
                 '--dataset (a TFDS name), not both.')
  if args.data_dir and not os.path.isdir(args.data_dir):
    parser.error(f'--data_dir={args.data_dir}: no such directory.')
  return args, config


def main(argv: list[str]) -> None:
  args, config = parse(argv)
  # pylint: disable=g-import-not-at-top
  if args.task == 'translate':
    # Before JAX starts its threads. Not for the copy task: its steps are
    # small, and one malloc arena would slow its compiles (host_memory.py).
    from flaxformer_mini import host_memory
    host_memory.keep_freed_memory()
  if args.compilation_cache:
    import jax
    jax.config.update('jax_compilation_cache_dir', args.compilation_cache)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  if args.tour:
    from flaxformer_mini import tour
    tour.print_tour(config, args.workdir)
    return
  from flaxformer_mini import attention, experiment, parallel
  if args.multihost or args.coordinator_address:
    parallel.initialize_multihost(args.coordinator_address, args.num_processes,
                                  args.process_id)
  try:
    parallel.check_divisible(config.batch_size)
    attention.check_backend(config)
  except ValueError as e:
    build_parser().error(str(e))
  from flaxformer_mini.checkpoints import CheckpointError
  from flaxformer_mini.data import DataError
  workdir = args.workdir or os.path.join('runs', args.task)
  try:
    if args.task == 'copy':
      experiment.run_copy_task(config, workdir, _START, fresh=args.fresh)
    else:
      experiment.run_translate(config, workdir, _START, args.data_dir,
                               args.dataset, args.tfds_dir, args.fresh)
  except (CheckpointError, DataError) as e:
    sys.exit(f'train.py: error: {e}')
  except experiment.NonFiniteLoss as e:
    sys.exit(f'train.py: {e}')
  except experiment.Interrupted as e:
    print(f'train.py: {e}', file=sys.stderr)
    sys.exit(128 + e.signum)


if __name__ == '__main__':
  main(sys.argv[1:])
