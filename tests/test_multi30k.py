"""Fetching Multi30k: whole files or none, checked against the repository's."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import MULTI30K, ROOT
from flaxformer_mini import disk
from flaxformer_mini.data import DataError, multi30k

needs_multi30k = pytest.mark.skipif(
    not os.path.isdir(MULTI30K), reason=f'Multi30k is not at {MULTI30K}')
# Port 9 (discard) of this machine refuses connections: offline, at once.
_NOWHERE = 'http://127.0.0.1:9/'


@needs_multi30k
def test_the_pinned_checksums_are_those_of_the_files():
  assert multi30k.missing(MULTI30K) == []


@needs_multi30k
def test_a_file_cut_short_is_fetched_again(tmp_path, monkeypatch):
  monkeypatch.setattr(multi30k, 'URL', f'file://{MULTI30K}/')  # the local copy
  whole = (open(os.path.join(MULTI30K, 'val.en.gz'), 'rb').read())
  (tmp_path / 'val.en.gz').write_bytes(whole[:1000])
  assert 'val.en.gz' in multi30k.missing(str(tmp_path))
  assert sorted(multi30k.download(str(tmp_path))) == sorted(multi30k.SHA256)
  assert multi30k.missing(str(tmp_path)) == []
  assert multi30k.download(str(tmp_path)) == []  # whole files are kept
  assert not [name for name in os.listdir(tmp_path)
              if name.endswith(disk.PARTIAL)]


def test_no_internet_is_one_clear_error(tmp_path, monkeypatch):
  monkeypatch.setattr(multi30k, 'URL', _NOWHERE)
  with pytest.raises(DataError, match='could not fetch .* check the internet '
                     'connection'):
    multi30k.download(str(tmp_path / 'data'))
  result = subprocess.run(
      [sys.executable, '-c', 'import sys; from flaxformer_mini.data import '
       f'multi30k; multi30k.URL = {_NOWHERE!r}; multi30k.main(sys.argv[1:])',
       str(tmp_path / 'data')], capture_output=True, text=True, cwd=ROOT,
      timeout=120)
  assert result.returncode == 1
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith('multi30k: error: could not fetch')


@needs_multi30k
def test_a_file_that_arrives_damaged_is_refused_and_not_kept(tmp_path, monkeypatch):
  served = tmp_path / 'served'
  shutil.copytree(MULTI30K, served)
  (served / 'train.de.gz').write_bytes(b'not the file')
  monkeypatch.setattr(multi30k, 'URL', f'file://{served}/')
  with pytest.raises(DataError, match=r'train\.de\.gz arrived damaged \(its SHA-256 differs\); '
                                      r'run again\.$'):
    multi30k.download(str(tmp_path / 'data'))
  assert not (tmp_path / 'data' / 'train.de.gz').exists()


def _main(directory: str, url: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, '-c', 'import sys; from flaxformer_mini.data import '
       f'multi30k; multi30k.URL = {url!r}; multi30k.main(sys.argv[1:])',
       directory], capture_output=True, text=True, cwd=ROOT, timeout=120)


@needs_multi30k
def test_a_target_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
  """A file, a folder under a file, a folder that refuses the write: one
  line naming the folder and what to do, exit code 1, no traceback."""
  (tmp_path / 'a_file').write_text('')
  for target, why in ((tmp_path / 'a_file', 'File exists'),
                      (tmp_path / 'a_file' / 'data', 'Not a directory')):
    result = _main(str(target), f'file://{MULTI30K}/')
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == (f'multi30k: error: {target}: {why}; give a folder you can '
                    'write.')
  # A read-only disk: the write of a file's .part copy is refused.
  monkeypatch.setattr(multi30k, 'URL', f'file://{MULTI30K}/')
  real_open = open

  def read_only(path, mode='r', *args, **kwargs):
    if 'w' in mode:
      raise OSError(30, 'Read-only file system', path)
    return real_open(path, mode, *args, **kwargs)

  monkeypatch.setattr('builtins.open', read_only)
  with pytest.raises(DataError, match=(
      rf'^{tmp_path / "data"}: Read-only file system; give a folder you can '
      r'write.$')):
    multi30k.download(str(tmp_path / 'data'))
