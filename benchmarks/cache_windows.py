"""What growing the key/value cache in windows buys beam search (CPU).

  python benchmarks/cache_windows.py [--workdir W] [--write_docs]

A step's parts, per beam row, at a cache of max_len = 82 positions (a
32-token source + 50, the Multi30k test set's middle batch shape) and at
the windows beam search now steps in (decoding.cache_windows: 24 and 48):
the whole step (the decoder's layers, the vocabulary's normalizer and the
choice of the best candidates as the search makes it, and the cache
reordered with the beams), the same with the cross-attention keys and
values repeated for every beam (where the search reads them once per
sentence), with XLA's own top-k (jax.lax.top_k, where
the search takes search.top_k_in_blocks), the step without the reordering,
and without the vocabulary either. --rows 256 (64 sentences x 4
beams), the run's model (without --workdir: the multi30k preset's, random),
--steps 30 a call, timed in turns.

With --workdir (a trained translation run): the test set searched as the
translate command does (translation.translate_ids), with the cache in
windows and without, each compiled first, then timed in turns; and how many
of the 1,000 translations are the same. The same for the exported search
(export.export_search, in windows) against beam_decode exported with its
whole cache. --write_docs writes the table into docs/performance.md.
"""

import argparse
import statistics

import jax
import jax.export
import jax.numpy as jnp
import numpy as np

from flaxformer_mini import decoding, export, search, translation
from flaxformer_mini import workdir as workdir_lib
from flaxformer_mini.config import get_config
from flaxformer_mini.training import init_params

import common
import translate_command

BEAMS, SRC_LEN, MAX_LEN = 4, 32, 82


def _in_blocks(logits, log_probs, forbidden):
  """The search's choice of the 2 x BEAMS best candidates of each item:
  logits float32[items, BEAMS, vocab], each beam's log p plus its
  log_softmax, added only in the blocks that may hold the best, the
  forbidden tokens left out (search.best_extensions)."""
  return search.best_extensions(logits, log_probs, 2 * BEAMS, forbidden)


def _xla_top_k(logits, log_probs, forbidden):
  """The same choice by XLA's own top-k, over every candidate's sum."""
  logits = search._forbid(  # pylint: disable=protected-access
      jax.nn.log_softmax(logits) + log_probs[..., None], list(forbidden))
  return jax.lax.top_k(logits.reshape(logits.shape[0], -1), 2 * BEAMS)


def _steps(params, src, config, length: int, reorder: bool, select,
           steps: int, per_beam: bool):
  """`steps` decoder steps of src's BEAMS beams each on a cache of `length`
  positions -> a scalar; select: the choice of the best candidates with
  the vocabulary's normalizer (_in_blocks, as the search chooses, or
  _xla_top_k), or None (no vocabulary); per_beam: the encoder output
  repeated for every beam, so that each beam row reads its own copy of the
  cross-attention keys and values (as the search did before they were read
  once per sentence)."""
  rows = src.shape[0] * BEAMS
  tokens_to_logits, _ = decoding.encoded_for_search(
      params, search.expand_to_beams(src, BEAMS) if per_beam else src,
      config, length)
  cache = decoding.init_cache(config, rows, length)
  # Every item's beams swapped around: a reordering that moves every row.
  beams = jnp.arange(rows).reshape(-1, BEAMS)[:, ::-1] % BEAMS

  def step(_, carry):
    cache, total = carry
    logits, cache = tokens_to_logits(jnp.full((rows, 1), 5, jnp.int32), cache)
    if select:
      logits = logits.astype(jnp.float32).reshape(rows // BEAMS, BEAMS, -1)
      # Every beam's live log p 0; pad and bos forbidden, as the search's.
      best, _ = select(logits, jnp.zeros(logits.shape[:2]),
                       (config.pad_id, config.bos_id))
      total += best.sum()
    else:
      total += logits[:, 0].sum()
    if reorder:
      cache = search._gather_cache(cache, beams)  # pylint: disable=protected-access
    return cache, total

  return jax.lax.fori_loop(0, steps, step, (cache, 0.0))[1]


# name -> _steps's (reorder, select, per_beam).
VARIANTS = {
    'step': (True, _in_blocks, False),
    'step, cross-attention per beam': (True, _in_blocks, True),
    "step, XLA's top-k": (True, _xla_top_k, False),
    'without reordering': (False, _in_blocks, False),
    'decoder layers only': (False, None, False)}


def step_parts(params, config, repeats: int, rows: int, steps: int,
               max_len: int) -> dict:
  """Microseconds per row-step of each part at each cache length."""
  src = jnp.full((rows // BEAMS, min(SRC_LEN, max_len)), 5, jnp.int32)
  run = jax.jit(_steps, static_argnums=(2, 3, 4, 5, 6, 7))
  lengths = (*decoding.cache_windows(max_len).lengths, max_len)
  runs = {}
  for length in lengths:
    for name, (reorder, select, per_beam) in VARIANTS.items():
      call = (lambda length=length, reorder=reorder, select=select,
              per_beam=per_beam:
              run(params, src, config, length, reorder, select, steps,
                  per_beam).block_until_ready())
      call()  # compiles
      runs[(name, length)] = call
  times = common.interleaved_seconds(runs, repeats)
  return {f'{name} @ {length}': statistics.median(times[(name, length)]) /
          (steps * rows) * 1e6 for name, length in runs}


def test_set_search(workdir: str, data_dir: str, rounds: int) -> dict:
  """The translate command's search of the test set, windows or not."""
  trained = workdir_lib.load_run(workdir)
  config, vocab = trained.config, trained.tokenizer
  lines = translate_command.split_lines(data_dir, config, 'test_2016_flickr')
  sources = [vocab.encode(line) for line in lines]
  runs = {name: (lambda grow: lambda: translation.translate_ids(
      trained.params, config, sources, grow_cache=grow))(grow)
          for name, grow in (('windows', True), ('whole cache', False))}
  return _in_turns(runs, rounds, len(lines), lambda a, b: sum(
      x == y for x, y in zip(a, b)))


def _in_turns(runs: dict, rounds: int, lines: int, same) -> dict:
  """runs['windows'] and runs['whole cache'], each compiled by a first
  call, then timed in turns; same(a, b): how many translations of the
  two outputs agree."""
  outputs = {name: run() for name, run in runs.items()}  # compiles
  times = common.interleaved_seconds(runs, rounds)
  medians = {name: statistics.median(t) for name, t in times.items()}
  return {'lines': lines,
          'seconds': times,
          'sentences_per_s': {n: lines / m for n, m in medians.items()},
          'speedup': medians['whole cache'] / medians['windows'],
          'same_translations': same(outputs['windows'],
                                    outputs['whole cache'])}


def _padded_batches(sources: list[list[int]], config, size: int = 64):
  """The translate command's batches (`translation._length_batches`: ids and
  eos, in length order, `size` to a batch), without its filler rows and
  each cut to its own longest rounded up to 16, where the command pads a
  whole input to one length: the shapes a program of one's own would call
  the export with. -> [int32[rows, width]]."""
  batches = []
  for members, src in translation._length_batches(config, sources, size):  # pylint: disable=protected-access
    src = src[:sum(member is not None for member in members)]
    longest = int((src != config.pad_id).sum(axis=1).max())
    batches.append(src[:, :min(-(-longest // 16) * 16, config.max_len)])
  return batches


def exported_search(workdir: str, data_dir: str, rounds: int) -> dict:
  """The exported search (export.export_search: its cache in windows, as
  long as the positional table) against beam_decode exported as it is
  (one loop over a cache of src_len + 50), on the test set's batches."""
  trained = workdir_lib.load_run(workdir)
  config, vocab = trained.config, trained.tokenizer
  params = jax.device_get(trained.params)
  leaves, treedef = jax.tree.flatten(params)
  lines = translate_command.split_lines(data_dir, config, 'test_2016_flickr')
  batches = _padded_batches([vocab.encode(line) for line in lines], config)

  def whole_cache(leaves, src):  # a tuple, tokens first, as the export's
    best = decoding.beam_decode(
        jax.tree.unflatten(treedef, leaves), src, config, beam_size=BEAMS,
        alpha=config.eval_alpha, stopping=config.eval_stopping)
    return (best.sequences[:, 0],)

  batch, src_len = jax.export.symbolic_shape(
      'batch, src_len', constraints=[f'src_len <= {config.max_len}'])
  exported = {
      'windows': export.export_search(params, config, beam_size=BEAMS,
                                      platforms=('cpu',)),
      'whole cache': jax.export.export(jax.jit(whole_cache),
                                       platforms=('cpu',))(
          [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves],
          jax.ShapeDtypeStruct((batch, src_len), jnp.int32))}
  runs = {name: (lambda e: lambda: [np.asarray(e.call(leaves, src)[0])
                                     for src in batches])(e)
          for name, e in exported.items()}
  return _in_turns(runs, rounds, len(lines), lambda a, b: int(sum(
      (x == y).all(axis=1).sum() for x, y in zip(a, b))))


def table(result: dict) -> str:
  env = result['environment']
  parts = result['step_parts']
  max_len = result['max_len']
  lengths = (*decoding.cache_windows(max_len).lengths, max_len)
  lines = [
      common.measured_by(
          env, 'benchmarks/cache_windows.py --workdir=W --write_docs') +
      'microseconds '
      f"per beam row and step, {result['rows']} rows, the run's model, "
      'medians in turns.', '',
      '| part of a step | ' + ' | '.join(
          f'cache of {n} positions' for n in lengths) + ' |',
      '|---|' + '---:|' * len(lengths)]
  for name in VARIANTS:
    lines.append(f'| {name} | ' + ' | '.join(
        f"{parts[f'{name} @ {n}']:.0f}" for n in lengths) + ' |')
  if 'test_set' in result:
    t = result['test_set']
    lines += ['', f"The test set's {t['lines']:,} lines searched as the "
              'translate command does (beam 4, the run\'s α and stopping '
              f"rule): {t['sentences_per_s']['windows']:.0f} sentences/s "
              f"with windows, {t['sentences_per_s']['whole cache']:.0f} "
              f"with the whole cache ({t['speedup']:.2f}x); "
              f"{t['same_translations']:,} of {t['lines']:,} translations "
              'the same.']
  if 'exported' in result:
    t = result['exported']
    rate = t['sentences_per_s']
    lines += ['', 'The exported search (`python -m flaxformer_mini.export`) '
              f"on the same lines, batches of 64: {rate['windows']:.0f} "
              'sentences/s with its cache in windows, '
              f"{rate['whole cache']:.0f} with beam_decode's whole cache "
              f"({t['speedup']:.2f}x); "
              f"{t['same_translations']:,} of {t['lines']:,} translations "
              'the same.']
  return '\n'.join(lines)


MARKERS = ('<!-- cache-windows:start -->', '<!-- cache-windows:end -->')


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--workdir', help='a trained translation workdir')
  parser.add_argument('--data_dir', default=translate_command.MULTI30K)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--rows', type=int, default=256)
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--write_docs', action='store_true')
  args = parser.parse_args()
  if args.workdir:
    trained = workdir_lib.load_run(args.workdir)
    config, params = trained.config, trained.params
  else:
    config = get_config('multi30k').replace(cpu_kernels=True)
    params = init_params(config, jax.random.key(0))
  # A model trained with a shorter positional table steps within it.
  max_len = min(MAX_LEN, config.max_len)
  result = {'environment': common.environment(), 'rows': args.rows,
            'max_len': max_len,
            'step_parts': step_parts(params, config, args.repeats, args.rows,
                                     args.steps, max_len)}
  if args.workdir:
    result['test_set'] = test_set_search(args.workdir, args.data_dir,
                                         args.rounds)
    result['exported'] = exported_search(args.workdir, args.data_dir,
                                         args.rounds)
  common.emit(result)
  if args.write_docs:
    translate_command.write_docs(table(result), MARKERS)


if __name__ == '__main__':
  main()
