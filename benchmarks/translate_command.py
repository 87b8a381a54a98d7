"""The translate command's speed where users feel it: a test set, beam 4.

  python benchmarks/translate_command.py --workdir runs/multi30k-en-de \
      --data_dir ../shared/data/multi30k

With a trained workdir: its model translates the test split's source lines
(test_2016_flickr: 1,000 lines) as `python -m flaxformer_mini.translate`
does (decoding.translate_ids: sorted by length, batches of --batch_size,
beam --beam; ended sentences leave their batch on the way), twice: the
first pass compiles, the second is timed. Reports sentences/s and generated
tokens/s (eos included). The same again in one stage (shrink_batches=False:
every batch searches to its slowest sentence), against the first in this
process, with the share of its row-steps that go to sentences already ended.

Then the same search against the Flax WMT example's beam_search on the same
model shape (random weights, eos impossible so both do the same work, the
batch and generated length of an average test batch), timed in turns
(decode.py's measure). Without --workdir, only this comparison runs, on the
multi30k preset's shape.
"""

import argparse
import functools
import os
import time

from flaxformer_mini import decoding
from flaxformer_mini.decoding import translate_ids
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.config import get_config
from flaxformer_mini.data import parallel_text
from flaxformer_mini.data.lines import read_lines

import common
import decode as decode_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI30K = os.path.join(os.path.dirname(ROOT), 'shared', 'data', 'multi30k')


def _test_sources(data_dir: str, config, split: str) -> list[str]:
  files = parallel_text.local_split_files(data_dir,
                                          (config.src_lang, config.tgt_lang))
  return [line.strip() for line in read_lines(files[split][0])]


def _timed_passes(run) -> tuple[float, float, list]:
  """run() twice: -> (first pass s, second pass s, the second's outputs)."""
  start = time.perf_counter()
  run()
  first_s = time.perf_counter() - start
  start = time.perf_counter()
  outputs = run()
  return first_s, time.perf_counter() - start, outputs


def translate_command(workdir: str, data_dir: str, split: str, beam: int,
                      batch_size: int) -> tuple[dict, object]:
  """The trained model on the test split -> (figures, its config)."""
  trained = workdir_lib.load_run(workdir)
  config, params = trained.config, trained.params
  sources = [trained.tokenizer.encode(line) for line in
             _test_sources(data_dir, config, split)]
  run = functools.partial(translate_ids, params, config, sources,
                          beam_size=beam, batch_size=batch_size)
  first_s, seconds, outputs = _timed_passes(run)
  one_first_s, one_seconds, one_outputs = _timed_passes(
      functools.partial(run, shrink_batches=False))
  generated = sum(len(o) + 1 for o in outputs)  # + eos
  # Row-steps to each batch's longest output against those the sentences
  # needed (the batches are sorted by source length, as translate_ids makes
  # them): what one-stage batches spend past each sentence's end.
  order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
  needed = spent = 0
  for start_row in range(0, len(order), batch_size):
    lengths = [len(outputs[i]) + 1 for i in order[start_row:start_row + batch_size]]
    needed += sum(lengths)
    spent += max(lengths) * len(lengths)
  return {'sentences': len(sources), 'beam': beam, 'batch_size': batch_size,
          'params': trained.which, 'first_pass_s': first_s, 'seconds': seconds,
          'sentences_per_s': len(sources) / seconds,
          'generated_tokens_per_s': generated / seconds,
          'mean_generated_tokens': generated / len(sources),
          'one_stage': {'first_pass_s': one_first_s, 'seconds': one_seconds,
                        'sentences_per_s': len(sources) / one_seconds,
                        'row_steps_after_the_end': 1 - needed / spent,
                        'same_translations': one_outputs == outputs},
          'speed_up_over_one_stage': one_seconds / seconds}, config


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--workdir', help='a trained translation workdir')
  parser.add_argument('--data_dir', default=MULTI30K)
  parser.add_argument('--split', default='test_2016_flickr')
  parser.add_argument('--beam', type=int, default=4)
  parser.add_argument('--batch_size', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--no_baseline', action='store_true')
  args = parser.parse_args()
  result = {'benchmark': 'translate'}
  if args.workdir:
    result['command'], config = translate_command(
        args.workdir, args.data_dir, args.split, args.beam, args.batch_size)
    gen_len = int(round(result['command']['mean_generated_tokens']))
  else:
    config, gen_len = get_config('multi30k'), 16
  config = config.replace(dropout_rate=0.0)
  # Multi30k's sources and targets are about as long; an untrained model
  # can run to the length limit.
  gen_len = src_len = min(gen_len, config.max_len - 1)
  params, src = decode_bench.random_model_and_sources(config, args.batch_size,
                                                      src_len)
  baseline = None if args.no_baseline else decode_bench.flax_wmt_params(config)
  result['search'] = {
      'batch': args.batch_size, 'src_len': src_len, 'gen_len': gen_len,
      **decode_bench.measure(config, params, baseline, src, args.beam,
                             min(gen_len, decoding.default_max_len(
                                 config, src_len)), args.repeats)}
  common.emit(result)


if __name__ == '__main__':
  main()
