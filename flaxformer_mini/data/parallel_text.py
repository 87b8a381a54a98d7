"""Parallel text through tensorflow-datasets: local files or the TFDS catalog.

Both paths end in the same place: a TFDS builder prepared in array_record
format and read with `as_data_source()`, random access by index, with no
TensorFlow at training time.

  * Local files in the Multi30k task-1 layout (`train.de.gz`, `train.en.gz`,
    `val.*`, `test_2016_flickr.*`, gzipped or plain) go through the project's
    own builder, `LocalParallelText`, prepared under WORKDIR/tfds. What is
    prepared is named for a fingerprint of the files' contents, so changed
    files are prepared again, never read stale.
  * A catalog dataset by name (e.g. `wmt14_translate/de-en`,
    `ted_hrlr_translate/pt_to_en`) must already be prepared in --tfds_dir
    (preparing WMT needs TensorFlow and internet: `pip install tensorflow`,
    then `tfds build NAME`); an unprepared one is an error here, never a
    silent download attempt.
"""

import contextlib
import hashlib
import importlib.util
import io
import logging
import os
import tempfile

import tensorflow_datasets as tfds

from flaxformer_mini.data import DataError
from flaxformer_mini.data.lines import read_lines

# File prefix -> TFDS split name.
_SPLIT_NAMES = {'train': 'train', 'val': 'validation'}


def _count_lines(path: str) -> tuple[int, int]:
  """(lines, lines with text) of a text file, read as `read_lines` reads it.

  Raises:
    DataError: the file cannot be read (naming its line).
  """
  lines = with_text = 0
  for line in read_lines(path):
    lines += 1
    with_text += bool(line.strip())
  return lines, with_text


def _find(directory: str, prefix: str, lang: str) -> str | None:
  for name in (f'{prefix}.{lang}.gz', f'{prefix}.{lang}'):
    if os.path.isfile(os.path.join(directory, name)):
      return os.path.join(directory, name)
  return None


def find_split_files(directory: str, languages: tuple[str, str]) -> dict[
    str, tuple[str, str]]:
  """{split: (file of language 1, file of language 2)}, found by name only.

  Raises:
    DataError: a missing directory, no train or no val files, or a split
      present in one language only.
  """
  if not os.path.isdir(directory):
    raise DataError(f'--data_dir={directory}: no such directory; point it at '
                    'a folder with train.{lang}[.gz], val.{lang}[.gz], ... '
                    '(e.g. Multi30k task 1 raw).')
  prefixes = sorted({name.split('.')[0] for name in os.listdir(directory)
                     if any(f'.{lang}' in name for lang in languages)})
  splits = {}
  for prefix in prefixes:
    paths = [_find(directory, prefix, lang) for lang in languages]
    if None in paths:
      missing = languages[paths.index(None)]
      raise DataError(f'{directory}: {prefix} has no {missing} file '
                      f'({prefix}.{missing}[.gz]).')
    splits[_SPLIT_NAMES.get(prefix, prefix)] = tuple(paths)
  for prefix, split in _SPLIT_NAMES.items():
    if split not in splits:
      raise DataError(f'{directory}: no {prefix}.{languages[0]}[.gz] / '
                      f'{prefix}.{languages[1]}[.gz] files (the {split} '
                      'split).')
  return splits


def check_split_files(files: dict[str, tuple[str, str]]) -> None:
  """Reads every file once: each can be read, has text, and the two files
  of a split have as many lines.

  Raises:
    DataError: a file that cannot be read (naming its line), has no text,
      or files whose line counts differ.
  """
  for paths in files.values():
    (count, text), (other, other_text) = map(_count_lines, paths)
    if count != other:
      raise DataError(
          f'{paths[0]} has {count} lines but {paths[1]} has {other}: '
          'line i of one must translate line i of the other.')
    for path, lines_with_text in ((paths[0], text), (paths[1], other_text)):
      if not lines_with_text:
        why = 'every line is empty' if count else 'the file is empty'
        raise DataError(f'{path}: no text ({why}); every split needs '
                        'sentence pairs.')


def local_split_files(directory: str, languages: tuple[str, str]) -> dict[
    str, tuple[str, str]]:
  """`find_split_files`, then `check_split_files`."""
  files = find_split_files(directory, languages)
  check_split_files(files)
  return files


def file_stats(files: dict[str, tuple[str, str]]) -> dict[str, list[int]]:
  """{file name: [size, modification time, inode, change time]}: a cheap
  sign that files are unchanged since they were read (recorded when a run
  prepares them).

  Size and modification time alone miss an edit that keeps both (`cp -p`,
  `rsync -a`, `tar x` and `touch -r` set the modification time back); the
  change time cannot be set back, and a file replaced by another has
  another inode. Where any differs the contents are read and compared.
  """
  stats = {}
  for paths in files.values():
    for path in paths:
      status = os.stat(path)
      stats[os.path.basename(path)] = [status.st_size, status.st_mtime_ns,
                                       status.st_ino, status.st_ctime_ns]
  return stats


def fingerprint(files: dict[str, tuple[str, str]]) -> str:
  """A hash of the splits' names and file contents: what the data is."""
  digest = hashlib.sha256()
  for split, paths in sorted(files.items()):
    digest.update(split.encode())
    for path in paths:
      digest.update(os.path.basename(path).encode())
      with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
          digest.update(block)
  return digest.hexdigest()[:16]


class LocalParallelText(tfds.core.GeneratorBasedBuilder):
  """Aligned sentence pairs from local files, in file order.

  `disable_shuffling=True` keeps the examples in file order (TFDS would
  otherwise reorder them by key hash).
  """
  VERSION = tfds.core.Version('1.0.0')

  def __init__(self, *, files: dict[str, tuple[str, str]],
               languages: tuple[str, str], **kwargs):
    self._files = files
    self._languages = tuple(languages)
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    info = self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(
            {lang: tfds.features.Text() for lang in self._languages}),
        description='Parallel text from local files.',
        disable_shuffling=True)
    # Nothing about local files is in TFDS's bucket of pre-computed
    # statistics, and looking there makes an empty folder in the system's
    # temporary directory that is never removed, one per new content
    # (DatasetInfo.initialize_from_bucket, tensorflow_datasets 4.9).
    info.initialize_from_bucket = lambda: None
    return info

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    return {split: self._generate_examples(paths)
            for split, paths in self._files.items()}

  def _generate_examples(self, paths):
    pairs = zip(read_lines(paths[0]), read_lines(paths[1]))
    for index, (a, b) in enumerate(pairs):
      yield index, {self._languages[0]: a.strip(),
                    self._languages[1]: b.strip()}


def check_folder(path: str, flag: str, create: bool = True) -> None:
  """`path` is a folder, or can be one (made if `create`).

  Raises:
    DataError: naming `flag` where a file stands in the way, or the folder
      cannot be made.
  """
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise DataError(f'{flag}={path}: {existing} is a file, not a folder; '
                    'name a folder.')
  if create:
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise DataError(f'{flag}={path} cannot be made ({e.strerror}); name a '
                      'folder you can write to.') from None


def load_local(files: dict[str, tuple[str, str]], languages: tuple[str, str],
               tfds_dir: str, content: str) -> dict:
  """Prepares (once per content) and opens local files: {split: data source}.

  files: from `local_split_files`; content: their `fingerprint`, which names
  what is prepared. Each data source is random-access: `source[i]` is
  {lang: bytes}.
  """
  check_folder(tfds_dir, '--tfds_dir')
  name = f'{"-".join(sorted(languages))}-{content}'
  logging.getLogger('absl').addFilter(_LOCAL_CONFIG_NOTE)  # added once
  builder = LocalParallelText(
      files=files, languages=languages, data_dir=tfds_dir,
      config=tfds.core.BuilderConfig(name=name), file_format='array_record')
  with _in_memory_shuffle(), _without_download_notes():
    builder.download_and_prepare()
  return builder.as_data_source()


class _LocalConfigNote(logging.Filter):
  """TFDS's absl warning that a builder has a custom configuration: ours
  always has one, named for the files' fingerprint."""

  def filter(self, record):
    return 'Using custom data configuration' not in record.getMessage()


_LOCAL_CONFIG_NOTE = _LocalConfigNote()


@contextlib.contextmanager
def _without_download_notes():
  """TFDS prints "Downloading and preparing dataset Unknown size ... to
  DIR" and "downloaded and prepared to DIR" on stdout for every builder;
  for files already on this machine nothing is downloaded, so those two
  lines are dropped (its progress bars stay: a large corpus takes minutes;
  TQDM_DISABLE=1 hides them)."""
  with contextlib.redirect_stdout(io.StringIO()):
    yield


@contextlib.contextmanager
def _temporary_files_removed():
  """tfds.builder of a catalog dataset that is not prepared looks for its
  statistics on TFDS's bucket through a folder made with tempfile.mkdtemp
  and never removed (DatasetInfo.initialize_from_bucket, tensorflow_datasets
  4.9): one folder left in the system's temporary directory per refusal.
  While the builder is made, tempfile makes its folders inside one that is
  removed afterwards."""
  with tempfile.TemporaryDirectory() as scratch:
    system, tempfile.tempdir = tempfile.tempdir, scratch
    try:
      yield
    finally:
      tempfile.tempdir = system


@contextlib.contextmanager
def _in_memory_shuffle():
  """TFDS's writer holds a split's examples in memory up to 1 GB and spills
  the rest to temporary files through TensorFlow's file API, which this
  project does not install; without TensorFlow the local builder keeps a
  split of any size in memory instead (about 300 bytes a pair, during the
  one-time preparation only: 1.4 GB for WMT14's 4.5M pairs)."""
  if importlib.util.find_spec('tensorflow') is not None:
    yield
    return
  from tensorflow_datasets.core import shuffle  # pylint: disable=g-import-not-at-top
  limit = shuffle.MAX_MEM_BUFFER_SIZE
  shuffle.MAX_MEM_BUFFER_SIZE = float('inf')
  try:
    yield
  finally:
    shuffle.MAX_MEM_BUFFER_SIZE = limit


def load_catalog(name: str, tfds_dir: str | None) -> dict:
  """Opens a prepared TFDS catalog dataset: {split: data source}.

  Raises:
    DataError: TFDS does not know the name, it is not prepared in
      `tfds_dir` (offline it would otherwise retry downloads for minutes, and
      `data_source(..., download=False)` would return an empty dict), or it
      has no validation split.
  """
  if os.path.exists(name):
    raise DataError(f'--dataset={name} is a path; --dataset takes a TFDS '
                    'name (e.g. wmt14_translate/de-en): for a folder of '
                    'text files use --data_dir.')
  if tfds_dir is not None:
    check_folder(tfds_dir, '--tfds_dir', create=False)
  if name.startswith('wmt'):
    # Without h5py, the WMT builders register only when imported directly.
    import tensorflow_datasets.translate.wmt14  # pylint: disable=g-import-not-at-top,unused-import
  try:
    with _temporary_files_removed():
      builder = tfds.builder(name, data_dir=tfds_dir,
                             file_format='array_record')
  except tfds.core.registered.DatasetNotFoundError as e:
    raise DataError(f'--dataset={name}: TFDS does not know this dataset '
                    f'({str(e).splitlines()[0]}).') from None
  except Exception as e:  # pylint: disable=broad-except
    # A name TFDS cannot parse, or another library's ('huggingface:...')
    # without that library: what TFDS says, in one line.
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise DataError(f'--dataset={name}: TFDS cannot open it ({first[:150]}); '
                    'name a TFDS catalog dataset, e.g. '
                    'wmt14_translate/de-en.') from None
  if not builder.is_prepared():
    raise DataError(
        f'--dataset={name} is not prepared in --tfds_dir={tfds_dir}. Prepare '
        'it once where there is internet (`pip install tensorflow; tfds build '
        f'{name} --data_dir={tfds_dir} --file_format=array_record`), or use '
        '--data_dir with local files.')
  sources = builder.as_data_source()
  if 'validation' not in sources:
    raise DataError(f'--dataset={name} has no validation split (it has '
                    f'{", ".join(sources)}); translation needs one.')
  return sources


def pairs_of(source, languages: tuple[str, str]) -> tuple[list[str],
                                                          list[str]]:
  """All (source text, target text) of a TFDS data source, in order."""
  examples = source.__getitems__(range(len(source)))
  return ([e[languages[0]].decode('utf-8') for e in examples],
          [e[languages[1]].decode('utf-8') for e in examples])
