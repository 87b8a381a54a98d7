"""Real translation: TFDS data, SentencePiece, token batches, BLEU, translate.

Tests read Multi30k from ../shared/data/multi30k (next to the project), or a
small slice of it written to a temporary directory; they skip where it is
absent.
"""

import gc
import json
import os
import subprocess
import sys
import tempfile
import weakref

import numpy as np
import pytest

from flaxformer_mini import evaluation, loop
from flaxformer_mini import run as run_lib
from flaxformer_mini.config import get_config
from flaxformer_mini.data import batching, parallel_text, tokenized, tokenizer
from flaxformer_mini.data import prepared as prepared_lib
from conftest import MULTI30K, multi30k_lines as _lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_multi30k = pytest.mark.skipif(
    not os.path.isdir(MULTI30K),
    reason=f'Multi30k is not at {MULTI30K} (see the README: Training)')


def test_preparing_local_files_leaves_nothing_in_the_temporary_directory(
    tmp_path, monkeypatch):
  temporary = tmp_path / 'system_tmp'
  temporary.mkdir()
  monkeypatch.setattr(tempfile, 'tempdir', str(temporary))
  for lang, lines in (('de', 'ein Hund\nzwei Katzen\n'),
                      ('en', 'a dog\ntwo cats\n')):
    (tmp_path / f'train.{lang}').write_text(lines)
  files = {'train': (str(tmp_path / 'train.de'), str(tmp_path / 'train.en'))}
  splits = parallel_text.load_local(files, ('de', 'en'), str(tmp_path / 'tfds'),
                                    'two-lines')
  assert splits['train'][1]['en'] == b'two cats'
  assert list(temporary.iterdir()) == []


@needs_multi30k
def test_local_builder_yields_aligned_pairs_in_file_order(tmp_path):
  files = parallel_text.local_split_files(MULTI30K, ('de', 'en'))
  splits = parallel_text.load_local(files, ('de', 'en'), str(tmp_path / 'tfds'),
                                    parallel_text.fingerprint(files))
  assert {name: len(source) for name, source in splits.items()} == {
      'train': 29000, 'validation': 1014, 'test_2016_flickr': 1000}
  for split, name in (('train', 'train'), ('val', 'validation')):
    de, en = _lines(split, 'de'), _lines(split, 'en')
    for index in (0, 1, 500, len(de) - 1):
      example = splits[name][index]
      assert example['de'].decode() == de[index].strip()
      assert example['en'].decode() == en[index].strip()


def test_a_split_past_tfds_memory_buffer_is_prepared_without_tensorflow(
    tmp_path, monkeypatch):
  """TFDS spills a split past its in-memory buffer (1 GB: WMT14's training
  split) to files through TensorFlow, which is not installed: the local
  builder keeps it in memory instead, and leaves TFDS's limit as it was."""
  from tensorflow_datasets.core import shuffle  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(shuffle, 'MAX_MEM_BUFFER_SIZE', 100)  # bytes
  for split in ('train', 'val'):
    for lang in ('de', 'en'):
      (tmp_path / f'{split}.{lang}').write_text(
          ''.join(f'{lang} sentence {i}\n' for i in range(50)))
  files = parallel_text.local_split_files(str(tmp_path), ('de', 'en'))
  sources = parallel_text.load_local(files, ('de', 'en'),
                                     str(tmp_path / 'tfds'), 'content')
  assert parallel_text.pairs_of(sources['train'], ('de', 'en'))[1][49] == (
      'en sentence 49')
  assert shuffle.MAX_MEM_BUFFER_SIZE == 100


def test_preparing_local_files_says_nothing_of_downloading(tmp_path, capfd):
  """TFDS announces a download of 'Unknown size' and where it prepared it,
  and warns of a custom configuration: none of it is true or news for files
  already here."""
  import logging  # pylint: disable=g-import-not-at-top
  said = []
  handler = logging.Handler()
  handler.emit = lambda record: said.append(record.getMessage())
  logging.getLogger('absl').addHandler(handler)
  for split in ('train', 'val'):
    for lang in ('de', 'en'):
      (tmp_path / f'{split}.{lang}').write_text(f'{lang} a\n{lang} b\n')
  files = parallel_text.local_split_files(str(tmp_path), ('de', 'en'))
  try:
    parallel_text.load_local(files, ('de', 'en'), str(tmp_path / 'tfds'), 'c')
  finally:
    logging.getLogger('absl').removeHandler(handler)
  out = capfd.readouterr().out
  assert 'Downloading' not in out and 'prepared to' not in out, out
  assert not [line for line in said if 'custom data configuration' in line]


def test_mismatched_line_counts_are_refused(tmp_path):
  (tmp_path / 'train.de').write_text('a\nb\nc\n')
  (tmp_path / 'train.en').write_text('a\nb\n')
  for lang in ('de', 'en'):
    (tmp_path / f'val.{lang}').write_text('a\n')
  with pytest.raises(parallel_text.DataError,
                     match=r'train.de has 3 lines but .*train.en has 2'):
    parallel_text.local_split_files(str(tmp_path), ('de', 'en'))


def test_a_missing_data_directory_is_refused(tmp_path):
  with pytest.raises(parallel_text.DataError, match='no such directory'):
    parallel_text.local_split_files(str(tmp_path / 'nowhere'), ('de', 'en'))
  (tmp_path / 'val.de').write_text('a\n')
  (tmp_path / 'val.en').write_text('a\n')
  with pytest.raises(parallel_text.DataError, match='no train.de'):
    parallel_text.local_split_files(str(tmp_path), ('de', 'en'))
  (tmp_path / 'val.de').unlink()
  (tmp_path / 'val.en').unlink()
  (tmp_path / 'train.de').write_text('a\n')
  (tmp_path / 'train.en').write_text('a\n')
  with pytest.raises(parallel_text.DataError,
                     match=r'no val.de\[.gz\] / val.en\[.gz\] files \(the '
                     r'validation split\)'):
    parallel_text.local_split_files(str(tmp_path), ('de', 'en'))


def test_an_unknown_tfds_name_is_refused(tmp_path):
  with pytest.raises(parallel_text.DataError,
                     match='--dataset=no_such_dataset: TFDS does not know'):
    parallel_text.load_catalog('no_such_dataset', str(tmp_path))


def test_an_unprepared_catalog_dataset_fails_at_once_and_leaves_nothing(
    tmp_path, monkeypatch):
  temporary = tmp_path / 'system_tmp'
  temporary.mkdir()
  monkeypatch.setattr(tempfile, 'tempdir', str(temporary))
  with pytest.raises(parallel_text.DataError,
                     match=r'ted_hrlr_translate/pt_to_en is not prepared'):
    parallel_text.load_catalog('ted_hrlr_translate/pt_to_en',
                               str(tmp_path / 'tfds'))
  assert list(temporary.iterdir()) == []
  assert tempfile.tempdir == str(temporary)


@needs_multi30k
def test_sentencepiece_round_trips_ordinary_sentences(tmp_path):
  config = get_config('translate').replace(src_vocab_size=500,
                                           tgt_vocab_size=500)
  sentences = _lines('train', 'de', 2000) + _lines('train', 'en', 2000)
  model = tokenizer.train_tokenizer(sentences, str(tmp_path / 'spm'), config)
  tokenizer.check_special_ids(model, config)
  for sentence in _lines('val', 'de', 20) + _lines('val', 'en', 20):
    ids = model.encode(sentence)
    assert config.pad_id not in ids and config.eos_id not in ids
    assert model.decode(ids) == ' '.join(sentence.split())


def _random_pairs(count, rng):
  lengths = rng.integers(1, 60, size=(count, 2))
  return ([np.full(a, 5, np.int32) for a, _ in lengths],
          [np.full(b, 6, np.int32) for _, b in lengths])


def test_token_batches_respect_the_budget_and_cover_each_example_once():
  config = get_config('translate').replace(max_len=64, seed=3)
  pairs = batching.Pairs(*_random_pairs(2000, np.random.default_rng(0)))
  batches = batching.TokenBatches(pairs, config, 1000, row_multiple=8)
  seen = []
  for step in range(batches.per_epoch):
    batch = batches.batch_at(step)
    rows, length = batch.src.shape
    assert rows % 8 == 0 and rows == batches.rows_of(length)
    assert rows * length <= 1000 and rows * batch.tgt_in.shape[1] <= 1000
    real = np.asarray(batch.src != config.pad_id).sum()
    assert real <= rows * length
  for _, members in batches.epoch_batches(0):
    seen.extend(members.tolist())
  assert sorted(seen) == list(range(len(pairs))) and batches.used == 2000
  assert len(batches.shapes()) <= len(batching.bucket_lengths(64))
  # Deterministic for a seed; the next epoch is another order.
  again = batching.TokenBatches(pairs, config, 1000, 8)
  np.testing.assert_array_equal(again.batch_at(5).src, batches.batch_at(5).src)
  orders = [[m.tolist() for _, m in batches.epoch_batches(epoch)]
            for epoch in (0, 1)]
  assert orders[0] != orders[1]


def test_token_batches_keep_their_own_plans_and_free_them_with_themselves():
  config = get_config('translate').replace(max_len=64)
  pairs = batching.Pairs(*_random_pairs(200, np.random.default_rng(4)))
  first = batching.TokenBatches(pairs, config, 1000)
  batching.TokenBatches(pairs, config.replace(seed=1), 1000).batch_at(0)  # another one's plans
  gone = weakref.ref(first)
  del first
  gc.collect()
  assert gone() is None  # no cache keeps a finished epoch's batches (and their pairs) alive


def test_a_shard_reads_only_its_own_rows_and_the_shards_make_the_batch():
  config = get_config('translate').replace(max_len=64)
  src, tgt = _random_pairs(300, np.random.default_rng(1))

  class Counted(batching.Pairs):
    read = []

    def pair(self, index):
      self.read.append(int(index))
      return super().pair(index)

  batches = batching.TokenBatches(Counted(src, tgt), config, 1000, 4)
  whole = batches.batch_at(2)
  members = batches.epoch_batches(0)[2][1].tolist()
  half = len(whole.src) // 2
  shards = []
  for index in range(2):
    Counted.read.clear()
    shards.append(batches.batch_at(2, (index, 2)))
    assert Counted.read == members[index * half:(index + 1) * half]
  np.testing.assert_array_equal(
      np.concatenate([np.asarray(s.tgt_out) for s in shards]),
      np.asarray(whole.tgt_out))


def test_empty_and_overlong_pairs_are_counted_and_left_out():
  src = [np.ones(3), np.ones(0), np.ones(100), np.ones(4)]
  tgt = [np.ones(3), np.ones(2), np.ones(5), np.ones(0)]
  config = get_config('translate').replace(max_len=64)
  batches = batching.TokenBatches(batching.Pairs(src, tgt), config, 1000)
  assert (batches.used, batches.empty, batches.too_long) == (1, 2, 1)
  assert [m.tolist() for _, m in batches.epoch_batches()] == [[0]]


def test_tokenized_splits_read_back_what_was_written(tmp_path):
  src, tgt = _random_pairs(50, np.random.default_rng(2))
  src[3] = np.zeros(0, np.int32)  # an empty sentence stays empty
  chunks = [(src[:20], tgt[:20]), (src[20:], tgt[20:])]
  for vocab_size, dtype in ((8000, np.uint16), (70_000, np.int32)):
    directory = str(tmp_path / str(vocab_size))
    tokenized.write_split(directory, 'train', chunks, vocab_size)
    assert tokenized.is_complete(directory, 'train')
    split = tokenized.TokenizedSplit(directory, 'train')
    assert len(split) == 50 and split.ids['src'].dtype == dtype
    for index in (0, 3, 19, 20, 49):
      for got, want in zip(split.pair(index), (src[index], tgt[index])):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        split.lengths(), [(len(a), len(b)) for a, b in zip(src, tgt)])


def test_an_interrupted_or_damaged_tokenized_split_is_named(tmp_path):
  src, tgt = _random_pairs(10, np.random.default_rng(3))

  def interrupted():
    yield src[:5], tgt[:5]
    raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    tokenized.write_split(str(tmp_path), 'train', interrupted(), 8000)
  assert not tokenized.is_complete(str(tmp_path), 'train')  # written again
  tokenized.write_split(str(tmp_path), 'train', [(src, tgt)], 8000)
  with open(tmp_path / 'train.tgt.ids', 'r+b') as f:
    f.truncate(6)
  with pytest.raises(tokenized.DataError, match=(
      r'the tokenized train split is damaged .*delete that folder and run '
      r'again')):
    tokenized.TokenizedSplit(str(tmp_path), 'train')


def test_ids_past_the_vocabulary_or_changed_bytes_are_named_when_opened(
    tmp_path):
  """Bits flipped in an id file, its size intact, would train on wrong ids
  (or make the loss NaN): opening the split names the file instead."""
  src, tgt = _random_pairs(10, np.random.default_rng(5))
  tokenized.write_split(str(tmp_path), 'train', [(src, tgt)], 300)
  ids = np.fromfile(tmp_path / 'train.src.ids', np.uint16)
  flipped = ids.copy()
  flipped[4] ^= 1  # another id, within the vocabulary
  flipped.tofile(tmp_path / 'train.src.ids')
  with pytest.raises(tokenized.DataError, match=(
      r'train.src.ids changed since it was written: its checksum differs\); '
      r'delete that folder and run again')):
    tokenized.TokenizedSplit(str(tmp_path), 'train')
  # A split written before the record held checksums: the vocabulary still
  # bounds its ids.
  record = json.loads((tmp_path / 'train.json').read_text())
  del record['crc32'], record['vocab_size']
  (tmp_path / 'train.json').write_text(json.dumps(record))
  flipped[4] = 3000
  flipped.tofile(tmp_path / 'train.src.ids')
  with pytest.raises(tokenized.DataError, match=(
      r'train.src.ids holds id 3000, past the vocabulary of 300\)')):
    tokenized.TokenizedSplit(str(tmp_path), 'train', vocab_size=300)
  ids.tofile(tmp_path / 'train.src.ids')
  assert len(tokenized.TokenizedSplit(str(tmp_path), 'train', 300)) == 10


class _Source:
  """A stand-in for a TFDS data source: source[i] is {lang: bytes}."""

  def __init__(self, count):
    self.examples = [{'de': f'de {i}'.encode(), 'en': f'en {i}'.encode()}
                     for i in range(count)]

  def __len__(self):
    return len(self.examples)

  def __getitems__(self, indices):
    return [self.examples[i] for i in indices]


def test_the_vocabulary_sample_is_seeded_bounded_and_checked():
  config = get_config('translate').replace(vocab_sample=3, seed=1)
  source = _Source(10)
  sample = tokenizer.sample_sentences(source, ('de', 'en'), config)
  assert sample == tokenizer.sample_sentences(source, ('de', 'en'), config)
  numbers = [s.split()[1] for s in sample]
  assert len(sample) == 6 and numbers[:3] == numbers[3:]  # both sides
  assert sample != tokenizer.sample_sentences(source, ('de', 'en'),
                                              config.replace(seed=2))
  whole = tokenizer.sample_sentences(source, ('de', 'en'),
                                     config.replace(vocab_sample=0))
  assert whole == [f'de {i}' for i in range(10)] + [f'en {i}'
                                                    for i in range(10)]
  assert tokenizer.sample_size(config.replace(vocab_sample=0),
                               5_000_000) == tokenizer.DEFAULT_SAMPLE
  with pytest.raises(tokenizer.DataError, match=(
      r'^--vocab_sample=11: more than the 10 training pairs; lower it, or 0 '
      r'for all of them \(up to 1,000,000\).$')):
    tokenizer.sample_sentences(source, ('de', 'en'),
                               config.replace(vocab_sample=11))


def test_bleu_of_references_against_themselves_is_100():
  references = _lines('val', 'en', 50) if os.path.isdir(MULTI30K) else [
      'A man rides a bike .', 'Two dogs play in the snow .']
  scores = evaluation.bleu(references, references)
  assert scores['bleu'] == pytest.approx(100.0)
  assert scores['bleu_lowercase'] == pytest.approx(100.0)
  assert 'tok:13a' in scores['signature'] and 'version:' in scores['signature']
  assert 'case:lc' in scores['signature_lowercase']
  assert 'case:mixed' in scores['signature']
  shouted = evaluation.bleu([r.upper() for r in references], references)
  assert shouted['bleu_lowercase'] == pytest.approx(100.0)
  assert shouted['bleu'] < 50


@pytest.mark.slow
def test_a_tiny_translation_run_trains_saves_and_scores(tiny_run):
  workdir, results = tiny_run
  assert results['steps'] == 12
  assert results['data']['pairs'] == {'train': 302, 'validation': 30,
                                      'test_2016_flickr': 30}
  data = results['data']
  assert data['train_skipped_empty'] == 1
  assert data['train_skipped_too_long'] >= 1  # the 200-word line at least
  assert (data['train_pairs_used'] + data['train_skipped_empty'] +
          data['train_skipped_too_long']) == 302
  assert 0.0 <= results['test_bleu'] <= 100.0
  assert results['test']['signature'].startswith('nrefs:1')
  assert 'case:lc' in results['test']['signature_lowercase']
  evaluation_ = results['evaluations'][0]
  assert evaluation_['val_perplexity'] > 1.0
  assert 0 < evaluation_['wall_minutes'] < 60
  assert {'val_bleu', 'val_bleu_lowercase'} <= set(evaluation_)
  assert results['history'][-1]['loss'] < results['history'][0]['loss']
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['12', '6']
  # Asked for three, the two checkpoints there are averaged; both the last
  # and the averaged parameters scored on validation; the better one scored
  # on test and kept for the translate command.
  assert results['config']['average_last'] == 3
  assert results['averaged_steps'] == [6, 12]
  validation = results['validation']
  assert set(validation) == {'latest', 'averaged'}
  chosen = results['translate_with']
  assert validation[chosen]['bleu'] == max(v['bleu'] for v in
                                           validation.values())
  assert os.path.isdir(workdir / 'averaged')
  on_disk = json.loads((workdir / 'results.json').read_text())
  assert on_disk['test_bleu'] == results['test_bleu']
  for picture in ('curves.png', 'bleu.png'):
    assert (workdir / picture).read_bytes()[:4] == b'\x89PNG'


@pytest.mark.slow
def test_translate_command_answers_every_line(tiny_run, tmp_path):
  """... and keeps its compiled programs in --compilation_cache."""
  workdir, _ = tiny_run
  lines = ['Ein Mann fährt Fahrrad.', '', 'Zwei Hunde spielen im Schnee.',
           '', ' '.join(['Hund'] * 80)]
  cache = tmp_path / 'xla'
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_mini.translate',
       f'--workdir={workdir}', '--beam_size=2', f'--compilation_cache={cache}'],
      input='\n'.join(lines) + '\n', capture_output=True, text=True,
      cwd=ROOT, timeout=600, env={**os.environ, 'JAX_LOG_COMPILES': '1'})
  assert result.returncode == 0, result.stderr[-3000:]
  kept = sorted(path.name for path in cache.glob('*.executable'))
  # The search's programs, whole: short lines and an overlong one share one
  # source length, so one first stage (and a later stage if one ran, and
  # one at the first stage's width where this barely trained model's
  # sentences still searched at the first stage's last window).
  assert [name.split('-')[0] for name in kept] in (
      ['first_stage'], ['first_stage', 'later_stage'],
      ['first_stage', 'later_stage', 'later_stage'])
  outputs = result.stdout.split('\n')[:-1]
  assert len(outputs) == len(lines)
  assert outputs[1] == '' and outputs[3] == ''
  assert 'line 5 has' in result.stderr  # the overlong line is reported

  # The next process loads them: the same output, and nothing traced, not
  # even the model's init for the parameters' shapes (kept beside them).
  again = subprocess.run(
      [sys.executable, '-m', 'flaxformer_mini.translate',
       f'--workdir={workdir}', '--beam_size=2', f'--compilation_cache={cache}'],
      input='\n'.join(lines) + '\n', capture_output=True, text=True,
      cwd=ROOT, timeout=600, env={**os.environ, 'JAX_LOG_COMPILES': '1'})
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout == result.stdout
  traced = lambda process: [line for line in process.stderr.splitlines()
                            if 'Finished tracing' in line]
  assert [line for line in traced(result) if 'stage' in line]  # logged
  assert traced(again) == []
  assert 'translate: note' not in again.stderr
  assert sorted(path.name for path in cache.glob('*.executable')) == kept

  # In slots refilled as sentences end: every line answered, three programs.
  slots = subprocess.run(
      [sys.executable, '-m', 'flaxformer_mini.translate',
       f'--workdir={workdir}', '--beam_size=2', '--refill',
       f'--compilation_cache={cache}'],
      input='\n'.join(lines) + '\n', capture_output=True, text=True,
      cwd=ROOT, timeout=600)
  assert slots.returncode == 0, slots.stderr[-3000:]
  outputs = slots.stdout.split('\n')[:-1]
  assert len(outputs) == len(lines) and outputs[1] == outputs[3] == ''
  added = sorted(path.name.split('-')[0] for path in cache.glob('*.executable')
                 if path.name not in kept)
  assert added == ['advance', 'fill', 'start_slots']  # one of each


@pytest.mark.slow
def test_the_translate_command_decodes_with_the_runs_alpha(tiny_run, tmp_path,
                                                          monkeypatch):
  """Without --alpha and --stopping the command searches as the run's scores
  were decoded, and so does translate_lines without them (the README's five
  lines)."""
  # pylint: disable=g-import-not-at-top
  from flaxformer_mini import translate, translation, workdir as workdir_lib
  workdir, results = tiny_run
  source = tmp_path / 'source.txt'
  source.write_text('Ein Hund.\n', encoding='utf-8')
  searched = []

  def search(params, src, config, beam_size, alpha, max_len, shrink,
             finished_first, stopping, grow_cache, mesh, programs):
    searched.append((alpha, stopping))
    yield  # a search of _one_batch_ahead
    return np.zeros((len(src), max_len), np.int32)

  monkeypatch.setattr(translation, '_beam_search_in_stages', search)
  for flags in ([], ['--alpha=0.3', '--stopping=beam_finished']):
    translate.main([f'--workdir={workdir}', f'--input={source}',
                    '--compilation_cache=', *flags])
  run = workdir_lib.load_run(str(workdir))
  translation.translate_lines(run.params, run.config, run.tokenizer, ['Ein Hund.'])
  own = (results['config']['eval_alpha'], results['config']['eval_stopping'])
  assert searched == [own, (0.3, 'beam_finished'), own]
  assert own[0] == 0.8


@pytest.mark.slow
def test_the_translate_command_decodes_in_the_dtype_asked(tiny_run, tmp_path,
                                                         capsys):
  """--dtype=bfloat16 searches a float32 run in bfloat16: what
  translate_lines gives with the run's config in bfloat16; without it, the
  run's own dtype."""
  # pylint: disable=g-import-not-at-top
  from flaxformer_mini import translate, translation
  from flaxformer_mini import workdir as workdir_lib
  workdir, _ = tiny_run
  lines = ['Ein Mann fährt Fahrrad.', 'Zwei Hunde spielen im Schnee.']
  source = tmp_path / 'source.txt'
  source.write_text('\n'.join(lines) + '\n', encoding='utf-8')
  run = workdir_lib.load_run(str(workdir))
  assert run.config.dtype == 'float32'
  for flags, dtype in (([], 'float32'), (['--dtype=bfloat16'], 'bfloat16')):
    translate.main([f'--workdir={workdir}', f'--input={source}',
                    '--beam_size=2', '--compilation_cache=', *flags])
    expected = translation.translate_lines(
        run.params, run.config.replace(dtype=dtype), run.tokenizer, lines,
        beam_size=2)
    assert capsys.readouterr().out == ''.join(line + '\n'
                                              for line in expected)
  with pytest.raises(SystemExit):
    translate.main([f'--workdir={workdir}', '--dtype=float16'])
  refused = capsys.readouterr().err.splitlines()
  assert len(refused) == 1 and refused[0].startswith(  # one line
      "python -m flaxformer_mini.translate: error: argument --dtype: invalid "
      "choice: 'float16' (choose from ")


@pytest.mark.slow
def test_the_translate_command_samples_per_line_for_a_seed(tiny_run):
  """--sample: N drawn translations per line on consecutive lines, the same
  for a seed whatever --batch_size; top_k 1 is the greedy search."""
  workdir, _ = tiny_run
  lines = 'Ein Mann fährt Fahrrad.\n\nZwei Hunde spielen im Schnee.\n'

  def translate(*flags):
    result = subprocess.run(
        [sys.executable, '-m', 'flaxformer_mini.translate',
         f'--workdir={workdir}', '--compilation_cache=', *flags],
        input=lines, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split('\n')[:-1]

  drawn = translate('--sample', '--seed=3', '--num_samples=3')
  assert len(drawn) == 9 and drawn[3:6] == ['', '', '']
  assert len(set(drawn[:3] + drawn[6:])) > 2  # the draws differ
  assert translate('--sample', '--seed=3', '--num_samples=3',
                   '--batch_size=1') == drawn
  assert translate('--sample', '--seed=4', '--num_samples=3') != drawn
  assert translate('--sample', '--top_k=1') == translate('--beam_size=1')


@pytest.mark.slow
def test_train_py_names_bad_translation_input(tmp_path):
  def run(*flags):
    return subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'),
                           '--task=translate', *flags], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
  missing = run(f'--data_dir={tmp_path / "none"}')
  assert missing.returncode == 2 and '--data_dir' in missing.stderr
  neither = run()
  assert neither.returncode == 2 and 'needs --data_dir' in neither.stderr
  unknown = run('--dataset=no_such_dataset', f'--workdir={tmp_path}')
  assert unknown.returncode != 0
  assert 'TFDS does not know' in unknown.stderr
  assert 'Traceback' not in unknown.stderr


@pytest.mark.slow
def test_translation_training_resumes_exactly(tiny_run, tmp_path):
  """8 steps, stopped and resumed for 8 more (across an epoch boundary), equal
  16 uninterrupted steps bitwise: the token batches are a function of the step."""
  # pylint: disable=g-import-not-at-top
  import jax
  from flaxformer_mini import checkpoints as ckpt
  from flaxformer_mini.config import TransformerConfig
  from flaxformer_mini.parallel import DataParallel
  workdir, results = tiny_run
  config = TransformerConfig(**results['config']).replace(
      dropout_rate=0.1, log_every=4, checkpoint_every=4, eval_every=10_000)
  # The tokenized split the run prepared, read as the run reads it.
  batches = batching.TokenBatches(
      tokenized.TokenizedSplit(str(workdir / 'tokens'), 'train'), config,
      config.tokens_per_batch)
  assert batches.per_epoch < 16

  def run(directory, steps):
    cfg = config.replace(train_steps=steps)
    parallel = DataParallel(cfg)
    with ckpt.Checkpoints(str(directory), writer=True) as checkpoints:
      state, rng, _ = run_lib.resume_or_start(cfg, checkpoints, parallel)
      state, _ = loop.train(cfg, state, rng, batches.batch_at,
                            parallel=parallel, checkpoints=checkpoints)
    return jax.tree.leaves((state.params, state.opt_state))

  whole = run(tmp_path / 'whole', 16)
  run(tmp_path / 'split', 8)
  resumed = run(tmp_path / 'split', 16)
  for a, b in zip(whole, resumed):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_a_second_start_reads_none_of_the_corpus(tiny_run, data_slice,
                                                 tmp_path, monkeypatch):
  """Once prepared, a start opens what was prepared: the data files are
  read and hashed again only when their size or time changed, and nothing
  is tokenized again for the same contents."""
  # pylint: disable=g-import-not-at-top
  import shutil
  from flaxformer_mini.config import TransformerConfig
  from flaxformer_mini.tasks import train_translation
  from flaxformer_mini.workdir import Workdir
  workdir, results = tiny_run
  config = TransformerConfig(**results['config'])
  run = tmp_path / 'run'
  run.mkdir()
  for name in ('prepared.json', 'spm.model', 'spm.vocab', 'tfds', 'tokens'):
    (shutil.copytree if (workdir / name).is_dir() else shutil.copy)(
        workdir / name, run / name)
  data = shutil.copytree(data_slice, tmp_path / 'data')  # moved: read again
  calls = []
  real_fingerprint = parallel_text.fingerprint

  def counted_fingerprint(files):
    calls.append('fingerprint')
    return real_fingerprint(files)

  def refused(*args, **kwargs):
    raise AssertionError('prepared again on a later start')

  monkeypatch.setattr(parallel_text, 'fingerprint', counted_fingerprint)
  monkeypatch.setattr(tokenized, 'write_split', refused)
  monkeypatch.setattr(tokenizer, 'train_tokenizer', refused)

  def prepare():
    with Workdir(str(run)) as opened:
      return prepared_lib.prepare(config, opened,
                                  prepared_lib.Source(str(data)))

  prepared = prepare()
  assert calls == ['fingerprint']  # another path: read and hashed once
  assert len(prepared.train) == results['data']['pairs']['train']
  assert sorted(prepared.texts) == ['test_2016_flickr', 'validation']
  monkeypatch.setattr(parallel_text, '_count_lines', refused)
  prepare()
  assert calls == ['fingerprint']  # unchanged since: not read at all
  monkeypatch.undo()
  monkeypatch.setattr(parallel_text, 'fingerprint', counted_fingerprint)
  monkeypatch.setattr(tokenized, 'write_split', refused)
  os.utime(data / 'val.en', ns=(1, 1))
  prepare()
  assert calls == ['fingerprint'] * 2  # touched: read and hashed again
