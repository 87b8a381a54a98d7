"""The persistent XLA compilation cache of train.py and the translate command.

A rerun (a resumed run, the next translate call, the same shapes in another
process) loads its compiled programs from disk instead of compiling them
again, which takes seconds per program on a CPU host.
"""

import os

_DEFAULT_DIR = os.environ.get('JAX_COMPILATION_CACHE_DIR', os.path.join(
    os.path.expanduser('~'), '.cache', 'flaxformer_mini', 'xla'))


def add_flag(parser) -> None:
  """--compilation_cache on an argparse parser (the folder, or '' for none)."""
  parser.add_argument(
      '--compilation_cache', default=_DEFAULT_DIR,
      help='persistent XLA compilation cache: a rerun loads the compiled '
      'programs instead of compiling them again ("" turns it off; default '
      '%(default)s).')


def use(directory: str) -> None:
  """Keeps every program compiled from now on in `directory` ('': none)."""
  if directory:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update('jax_compilation_cache_dir', directory)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
