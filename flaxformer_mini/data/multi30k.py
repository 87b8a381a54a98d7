"""Multi30k (task 1, raw): the files translation trains on, fetched and checked.

    python -m flaxformer_mini.data.multi30k DATA_DIR    # about 2 MB

fetches train, val and test_2016_flickr in German, English and French from
the public Multi30k repository, at a fixed commit, into DATA_DIR (the layout
`train.py --task=translate --data_dir=DATA_DIR` reads). Every file is checked
against its SHA-256, so a download cut short is never used: it is fetched
again, or refused in one line. Files already there and whole are kept.
"""

import hashlib
import os
import sys
import urllib.error
import urllib.request

from flaxformer_mini import disk
from flaxformer_mini.data import DataError

URL = ('https://raw.githubusercontent.com/multi30k/dataset/'
       'a3d2e0d26b56f3846f66a952536ffed4e401d05a/data/task1/raw/')
# The repository's files at that commit.
SHA256 = {
    'train.de.gz': '726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6',
    'train.en.gz': 'd79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f',
    'train.fr.gz': '622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c',
    'val.de.gz': 'f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a',
    'val.en.gz': '14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28',
    'val.fr.gz': 'ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9',
    'test_2016_flickr.de.gz':
        '9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8',
    'test_2016_flickr.en.gz':
        '611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9',
    'test_2016_flickr.fr.gz':
        '6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90',
}


def _sha256(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def missing(directory: str) -> list[str]:
  """The files of Multi30k that `directory` lacks or holds damaged."""
  return [name for name, digest in SHA256.items()
          if not os.path.isfile(os.path.join(directory, name)) or
          _sha256(os.path.join(directory, name)) != digest]


def download(directory: str, timeout: float = 60.0) -> list[str]:
  """Fetches every file `directory` lacks (or holds damaged); returns their
  names. A file is written whole or not at all.

  Raises:
    DataError: a file could not be fetched (no internet?), arrived other
      than the repository holds it, or `directory` cannot be written, with
      what to do.
  """
  try:
    os.makedirs(directory, exist_ok=True)
    fetched = []
    for name in missing(directory):
      _fetch(name, os.path.join(directory, name), timeout)
      fetched.append(name)
  except OSError as e:  # the target, not the network (_fetch names that)
    raise DataError(f'{directory}: {e.strerror or e}; give a folder you can '
                    'write.') from None
  return fetched


def _fetch(name: str, path: str, timeout: float) -> None:
  """Writes URL + name to `path`, whole or not at all."""
  try:
    with urllib.request.urlopen(URL + name, timeout=timeout) as response:
      data = response.read()
  except (urllib.error.URLError, OSError) as e:
    reason = getattr(e, 'reason', e)
    raise DataError(
        f'could not fetch {URL + name} ({reason}); check the internet '
        f'connection and run again, or copy the Multi30k files into '
        f'{os.path.dirname(path)} by hand.') from None
  if hashlib.sha256(data).hexdigest() != SHA256[name]:
    raise DataError(f'{URL + name} arrived damaged (its SHA-256 differs); '
                    'run again.')
  with disk.written_whole(path, 'wb') as f:
    f.write(data)


def main(argv: list[str]) -> None:
  from flaxformer_mini import cli  # pylint: disable=g-import-not-at-top
  parser = cli.OneLineParser(
      prog='python -m flaxformer_mini.data.multi30k',
      description=__doc__.split('\n\n')[0])
  parser.add_argument('directory', help='where the files go (made if missing)')
  args = parser.parse_args(argv)
  try:
    fetched = download(args.directory)
  except DataError as e:
    sys.exit(f'multi30k: error: {e}')
  print(f'{args.directory}: Multi30k is complete '
        f'({len(fetched)} of {len(SHA256)} files fetched now).')


if __name__ == '__main__':
  main(sys.argv[1:])
