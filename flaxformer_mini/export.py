"""The export command: a trained run's translation search as a jax.export artifact.

  python -m flaxformer_mini.export --workdir runs/translate --out exported/

writes into --out (a new folder) what a program needs to translate without
this package (or flax): jax, numpy, and sentencepiece for text.

  search.jax_export  the encoder and the beam search, serialized
                     (jax.export): any batch, any source length up to the
                     model's max_len, for CPU, GPU (CUDA) and TPU
  params.npz         its parameters, arr_0, arr_1, ... in the order it takes
  spm.model          the run's SentencePiece vocabulary
  signature.json     what it takes and returns, the ids, the search's settings

    from jax import export
    exported = export.deserialize(open('search.jax_export', 'rb').read())
    params = list(np.load('params.npz').values())
    tokens, scores, lengths, reached_eos = exported.call(params, src)

What does not export: a callback (beam_decode's on_step, jax.debug.callback)
cannot be serialized, so the search is exported without one.
"""

import json
import os
import shutil

from flaxformer_mini import cli
from flaxformer_mini import disk
from flaxformer_mini.config import STOPPING_RULES

ARTIFACT = 'search.jax_export'
PARAMS = 'params.npz'
SIGNATURE = 'signature.json'
PLATFORMS = ('cpu', 'cuda', 'tpu')


def export_search(params, config, *, beam_size: int = 4,
                  alpha: float | None = None, stopping: str | None = None,
                  platforms=PLATFORMS):
  """Transformer(config)'s beam search as a jax.export.Exported.

  It takes (the parameters' leaves, in jax.tree.leaves order; src
  int32[batch, src_len], each row a sentence's ids, eos, then pad;
  src_len <= config.max_len) and returns the best hypothesis of each row:
  tokens int32[batch, max_len] (ids, eos, then pad), scores float32[batch],
  lengths int32[batch] (eos included), reached_eos bool[batch], where
  max_len = min(src_len + 50, config.max_len), each row's output at most
  its own source length + 50 tokens, as beam_decode's default.
  batch and src_len are symbolic: one export serves every shape. alpha
  and stopping None: the config's eval_alpha and eval_stopping, as the
  translate command decodes. The search is beam_decode's with
  grow_cache, its cache grown in windows as the command grows it.
  """
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.export
  import jax.numpy as jnp
  from flaxformer_mini import decoding
  # pylint: enable=g-import-not-at-top
  alpha = config.eval_alpha if alpha is None else alpha
  stopping = config.eval_stopping if stopping is None else stopping
  leaves, treedef = jax.tree.flatten(params)

  def search(leaves, src):
    # The cache grown in windows, as the translate command grows it: 1.34x
    # faster on a CPU on the Multi30k test set (docs/performance.md, "A
    # cache that grows").
    best = decoding.beam_decode(
        jax.tree.unflatten(treedef, leaves), src, config, beam_size=beam_size,
        alpha=alpha, stopping=stopping, grow_cache=True)
    return (best.sequences[:, 0], best.scores[:, 0], best.lengths[:, 0],
            best.reached_eos[:, 0])

  batch, src_len = jax.export.symbolic_shape(
      'batch, src_len', constraints=[f'src_len <= {config.max_len}'])
  return jax.export.export(jax.jit(search), platforms=platforms)(
      [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves],
      jax.ShapeDtypeStruct((batch, src_len), jnp.int32))


def signature(config, beam_size: int, alpha: float, stopping: str) -> dict:
  """What signature.json says: the inputs, the outputs, the ids, the search."""
  return {
      'call': 'exported.call(params, src)',
      'inputs': {
          'params': f'the arrays of {PARAMS} in order (arr_0, arr_1, ...)',
          'src': ('int32[batch, src_len], src_len <= max_len: each row a '
                  "sentence's SentencePiece ids (spm.model, "
                  'encode without bos or eos), then eos_id, then pad_id to '
                  "the row's end"),
      },
      'outputs': {
          'tokens': ('int32[batch, min(src_len + 50, max_len)]: the best '
                     'translation, its ids, eos_id if reached, then pad_id; '
                     "at most its own source's ids and eos + 50"),
          'scores': 'float32[batch]: log p / ((5 + length) / 6) ** alpha',
          'lengths': 'int32[batch]: tokens generated, eos included',
          'reached_eos': ('bool[batch]: False where the translation was cut '
                          'at the output length'),
      },
      'same_as_the_translate_command': (
          'pad each sentence as the translate command does: cut to max_len - '
          '1 ids, then to the longest of the input plus eos rounded up to a '
          'multiple of 16, within max_len (the output length follows '
          'src_len)'),
      'max_len': config.max_len, 'pad_id': config.pad_id,
      'bos_id': config.bos_id, 'eos_id': config.eos_id,
      'beam_size': beam_size, 'alpha': alpha, 'stopping': stopping,
      'platforms': list(PLATFORMS),
  }


def main(argv: list[str]) -> None:
  parser = cli.OneLineParser(prog='python -m flaxformer_mini.export',
                             description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--out', required=True,
                      help='the new folder to write the artifact into.')
  parser.add_argument('--params', choices=['best', 'latest', 'averaged'],
                      default='best')
  parser.add_argument('--beam_size', type=cli.positive_int, default=4)
  parser.add_argument('--alpha', type=cli.finite_float,
                      help="default: the run's eval_alpha, as the translate "
                      'command decodes.')
  parser.add_argument('--stopping', choices=STOPPING_RULES,
                      help="default: the run's eval_stopping, as the "
                      'translate command decodes.')
  args = parser.parse_args(argv)
  if missing := cli.missing_translation_extras():
    parser.error(missing)
  try:
    import flatbuffers  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    parser.error("serializing needs flatbuffers: pip install -e '.[export]' "
                 "(in a clone) or pip install 'flaxformer_mini[export]'.")
  try:
    disk.check_new_folder(args.out)  # before the run is read
  except OSError as e:
    parser.error(cli.out_error(args.out, e))
  # pylint: disable=g-import-not-at-top
  import jax
  import numpy as np
  from flaxformer_mini import workdir as workdir_lib
  # pylint: enable=g-import-not-at-top
  run = cli.load_translation_run(parser, args.workdir, args.params)
  vocabulary = workdir_lib.TOKENIZER + '.model'
  alpha = run.config.eval_alpha if args.alpha is None else args.alpha
  stopping = run.config.eval_stopping if args.stopping is None else args.stopping
  params = jax.device_get(run.params)
  exported = export_search(params, run.config, beam_size=args.beam_size,
                           alpha=alpha, stopping=stopping)
  try:
    with disk.new_folder(args.out) as folder:
      with open(os.path.join(folder, ARTIFACT), 'wb') as f:
        f.write(exported.serialize())
      np.savez(os.path.join(folder, PARAMS), *jax.tree.leaves(params))
      shutil.copyfile(os.path.join(args.workdir, vocabulary),
                      os.path.join(folder, vocabulary))
      with open(os.path.join(folder, SIGNATURE), 'w', encoding='utf-8') as f:
        json.dump(signature(run.config, args.beam_size, alpha, stopping), f,
                  indent=1)
  except OSError as e:
    parser.error(cli.out_error(args.out, e))
  print(f'exported the search of {args.workdir} (step {run.step}, '
        f'{run.which} parameters, beam {args.beam_size}, alpha {alpha}) to '
        f'{args.out}')


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  main(sys.argv[1:])
