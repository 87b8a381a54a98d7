"""Parallel text through tensorflow-datasets: local files or the TFDS catalog.

Both paths end in the same place: a TFDS builder prepared in array_record
format and read with `as_data_source()`, random access by index, with no
TensorFlow at training time.

  * Local files in the Multi30k task-1 layout (`train.de.gz`, `train.en.gz`,
    `val.*`, `test_2016_flickr.*`, gzipped or plain) go through the project's
    own builder, `LocalParallelText`, prepared under WORKDIR/tfds.
  * A catalog dataset by name (e.g. `wmt14_translate/de-en`,
    `ted_hrlr_translate/pt_to_en`) must already be prepared in --tfds_dir
    (preparing WMT needs TensorFlow and internet: `pip install
    'flaxformer_mini[tfds-build]'`, then `tfds build NAME`); an unprepared one
    is an error here, never a silent download attempt.
"""

import gzip
import os

import tensorflow_datasets as tfds

from flaxformer_mini.data import DataError

# File prefix -> TFDS split name.
_SPLIT_NAMES = {'train': 'train', 'val': 'validation'}


def open_text(path: str):
  """A text file, gzipped or plain, opened for reading as UTF-8."""
  opener = gzip.open if path.endswith('.gz') else open
  return opener(path, 'rt', encoding='utf-8')


def _find(directory: str, prefix: str, lang: str) -> str | None:
  for name in (f'{prefix}.{lang}.gz', f'{prefix}.{lang}'):
    if os.path.isfile(os.path.join(directory, name)):
      return os.path.join(directory, name)
  return None


def local_split_files(directory: str, languages: tuple[str, str]) -> dict[
    str, tuple[str, str]]:
  """{split: (file of language 1, file of language 2)} with line counts checked.

  Raises:
    DataError: a missing directory, no train files, a split present in one
      language only, or files whose line counts differ.
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
    counts = []
    for path in paths:
      with open_text(path) as f:
        counts.append(sum(1 for _ in f))
    if counts[0] != counts[1]:
      raise DataError(
          f'{paths[0]} has {counts[0]} lines but {paths[1]} has {counts[1]}: '
          'line i of one must translate line i of the other.')
    splits[_SPLIT_NAMES.get(prefix, prefix)] = tuple(paths)
  if 'train' not in splits:
    raise DataError(f'{directory}: no train.{languages[0]}[.gz] / '
                    f'train.{languages[1]}[.gz] files.')
  return splits


class LocalParallelText(tfds.core.GeneratorBasedBuilder):
  """Aligned sentence pairs from local files, in file order.

  `disable_shuffling=True` keeps the examples in file order (TFDS would
  otherwise reorder them by key hash).
  """
  VERSION = tfds.core.Version('1.0.0')

  def __init__(self, *, source_dir: str, languages: tuple[str, str],
               **kwargs):
    self._source_dir = os.path.abspath(source_dir)
    self._languages = tuple(languages)
    self._files = local_split_files(self._source_dir, self._languages)
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(
            {lang: tfds.features.Text() for lang in self._languages}),
        description=f'Parallel text from {self._source_dir}.',
        disable_shuffling=True)

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    return {split: self._generate_examples(paths)
            for split, paths in self._files.items()}

  def _generate_examples(self, paths):
    with open_text(paths[0]) as first, open_text(paths[1]) as second:
      for index, (a, b) in enumerate(zip(first, second)):
        yield index, {self._languages[0]: a.strip(),
                      self._languages[1]: b.strip()}


def load_local(source_dir: str, languages: tuple[str, str],
               tfds_dir: str) -> dict:
  """Prepares (once) and opens local parallel files: {split: data source}.

  Each data source is random-access: `source[i]` is {lang: bytes}.
  """
  pair = '-'.join(sorted(languages))  # one prepared dataset per language pair
  builder = LocalParallelText(
      source_dir=source_dir, languages=languages, data_dir=tfds_dir,
      config=tfds.core.BuilderConfig(name=pair), file_format='array_record')
  builder.download_and_prepare()
  return builder.as_data_source()


def load_catalog(name: str, tfds_dir: str) -> dict:
  """Opens a prepared TFDS catalog dataset: {split: data source}.

  Raises:
    DataError: TFDS does not know the name, or it is not prepared in
      `tfds_dir` (offline it would otherwise retry downloads for minutes, and
      `data_source(..., download=False)` would return an empty dict).
  """
  if name.startswith('wmt'):
    # Without h5py, the WMT builders register only when imported directly.
    import tensorflow_datasets.translate.wmt14  # pylint: disable=g-import-not-at-top,unused-import
  try:
    builder = tfds.builder(name, data_dir=tfds_dir,
                           file_format='array_record')
  except tfds.core.registered.DatasetNotFoundError as e:
    raise DataError(f'--dataset={name}: TFDS does not know this dataset '
                    f'({str(e).splitlines()[0]}).') from None
  if not builder.is_prepared():
    raise DataError(
        f'--dataset={name} is not prepared in --tfds_dir={tfds_dir}. Prepare '
        'it once where there is internet (`pip install tensorflow; tfds build '
        f'{name} --data_dir={tfds_dir} --file_format=array_record`), or use '
        '--data_dir with local files.')
  return builder.as_data_source()
