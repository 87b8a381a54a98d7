"""A trained run as a CTranslate2 model: serving on the engine most deploy.

  python -m flaxformer_mini.to_ctranslate2 --workdir runs/translate --out ct2/

writes into --out (a new folder) a CTranslate2 model of the run's
parameters and its SentencePiece model, spm.model, to tokenize with:

    import os, ctranslate2, sentencepiece
    # On a CPU, one worker per core on one thread each: translate_batch's
    # batches of max_batch_size lines run side by side.
    translator = ctranslate2.Translator('ct2/', inter_threads=os.cpu_count(),
                                        intra_threads=1)
    vocab = sentencepiece.SentencePieceProcessor(model_file='ct2/spm.model')
    pieces = [vocab.encode(line, out_type=str) for line in lines]
    results = translator.translate_batch(pieces, beam_size=4,
                                         max_batch_size=64)
    print([vocab.decode(r.hypotheses[0]) for r in results])

The model is the same function: teacher-forced log-probabilities agree
within float32 rounding and greedy outputs token for token. Beam outputs
differ on some lines, because the searches differ: CTranslate2 divides a
hypothesis's log-probability by length**length_penalty, where this project
divides by GNMT's ((5 + length) / 6)**alpha, and it ends a sentence when
beam_size hypotheses have finished.
"""

import importlib.util
import os
import shutil

import jax
import numpy as np

from flaxformer_mini import cli
from flaxformer_mini import disk
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.embeddings import sinusoidal_positions

# CTranslate2's default max_decoding_length (Translator.translate_batch).
CTRANSLATE2_DECODING_LENGTH = 256
# CTranslate2's weight types (ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES).
QUANTIZATIONS = ('float32', 'int8', 'int8_float32', 'int8_float16',
                 'int8_bfloat16', 'int16', 'float16', 'bfloat16')


class ConversionError(ValueError):
  """The run cannot be written as a CTranslate2 model (one line: why)."""


def transformer_spec(params, config: TransformerConfig, pieces: list[str]):
  """Transformer(config) with `params` as a ctranslate2.specs.TransformerSpec.

  params: the model's parameter tree (host or device arrays); pieces: the
  SentencePiece vocabulary, piece i for id i, the source's and the
  target's. The source gets eos appended, as the project feeds it, and
  decoding starts at bos.

  Raises:
    ConversionError: the vocabulary does not fit the model.
  """
  # pylint: disable-next=g-import-not-at-top
  from ctranslate2.specs import transformer_spec as ct2
  for side, size in (('source', config.src_vocab_size),
                     ('target', config.tgt_vocab_size)):
    if size != len(pieces):
      raise ConversionError(
          f'the model has {size} {side} ids but its vocabulary {len(pieces)} '
          'pieces: CTranslate2 needs one token per id.')
  # CTranslate2 takes float32 numpy arrays.
  p = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  spec = ct2.TransformerSpec.from_config(
      (config.num_encoder_layers, config.num_decoder_layers),
      config.num_heads, pre_norm=config.pre_norm)
  # The project's table is interleaved (sin, cos, sin, ...) and starts at
  # position 0; CTranslate2's own is [sin | cos] from position 1: pass ours.
  # It goes on past max_len (the same sinusoids; the translate command cuts
  # sources and outputs at max_len) so that CTranslate2's default
  # max_decoding_length does not run off its end.
  table = sinusoidal_positions(max(config.max_len, CTRANSLATE2_DECODING_LENGTH),
                               config.d_model)
  if config.share_embeddings:
    source = target = p['shared_embedding']['embed']['embedding']
  else:
    source = p['source_embedding']['embed']['embedding']
    target = p['target_embedding']['embed']['embedding']
  for stack, embedding, side in ((spec.encoder, source, p['encoder']),
                                 (spec.decoder, target, p['decoder'])):
    embeddings = (stack.embeddings[0] if stack is spec.encoder else
                  stack.embeddings)
    embeddings.weight = embedding
    stack.scale_embeddings = True  # x sqrt(d_model), as TokenEmbedding
    stack.position_encodings.encodings = table
    if config.pre_norm:
      _layer_norm(stack.layer_norm, side['final_norm'])
  for i, layer in enumerate(spec.encoder.layer):
    ours = p['encoder'][f'layer_{i}']
    _attention(layer.self_attention, ours['self_attention'],
               ours['self_attention_norm'], self_attention=True)
    _feed_forward(layer.ffn, ours['feed_forward'], ours['feed_forward_norm'])
  for i, layer in enumerate(spec.decoder.layer):
    ours = p['decoder'][f'layer_{i}']
    _attention(layer.self_attention, ours['self_attention'],
               ours['self_attention_norm'], self_attention=True)
    _attention(layer.attention, ours['cross_attention'],
               ours['cross_attention_norm'], self_attention=False)
    _feed_forward(layer.ffn, ours['feed_forward'], ours['feed_forward_norm'])
  if config.tie_output_embedding:
    spec.decoder.projection.weight = target
  else:
    _linear(spec.decoder.projection, p['output_projection'])
  spec.config.layer_norm_epsilon = config.layer_norm_epsilon
  spec.config.unk_token = pieces[config.first_ordinary_id]
  spec.config.bos_token = spec.config.decoder_start_token = pieces[
      config.bos_id]
  spec.config.eos_token = pieces[config.eos_id]
  spec.config.add_source_eos = True
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  return spec


def _linear(spec, dense) -> None:
  """A flax Dense ({'kernel': [in, out], 'bias'}) as [out, in] and bias."""
  spec.weight = np.ascontiguousarray(dense['kernel'].T)
  if 'bias' in dense:
    spec.bias = dense['bias']


def _layer_norm(spec, norm) -> None:
  norm = norm.get('LayerNorm_0', norm)
  spec.gamma, spec.beta = norm['scale'], norm['bias']


def _attention(spec, ours, norm, self_attention: bool) -> None:
  """MultiHeadAttention: Q, K, V fused (self) or Q, then K and V fused
  (cross); the keys have no bias (attention.py says why): zeros."""
  wq, wk, wv = (ours[name]['kernel'].T for name in ('wq', 'wk', 'wv'))
  bq, bv = ours['wq']['bias'], ours['wv']['bias']
  bk = np.zeros_like(bq)
  if self_attention:
    spec.linear[0].weight = np.concatenate([wq, wk, wv])
    spec.linear[0].bias = np.concatenate([bq, bk, bv])
  else:
    spec.linear[0].weight, spec.linear[0].bias = np.ascontiguousarray(wq), bq
    spec.linear[1].weight = np.concatenate([wk, wv])
    spec.linear[1].bias = np.concatenate([bk, bv])
  _linear(spec.linear[-1], ours['wo'])
  _layer_norm(spec.layer_norm, norm)


def _feed_forward(spec, ours, norm) -> None:
  _linear(spec.linear_0, ours['wi'])
  _linear(spec.linear_1, ours['wo'])
  _layer_norm(spec.layer_norm, norm)


def convert(params, config: TransformerConfig, pieces: list[str], out: str,
            quantization: str = 'float32', files: tuple[str, ...] = ()) -> None:
  """Writes the CTranslate2 model, and copies of `files`, into the new
  folder `out`, all or nothing: it is built beside `out` and renamed into
  place.

  Raises:
    ConversionError: the run cannot be expressed.
    disk.FolderExists: `out` exists (nothing there was changed).
    OSError: `out`'s parent cannot be written.
  """
  disk.check_new_folder(out)  # before the conversion's work
  spec = transformer_spec(params, config, pieces)
  spec.validate()
  spec.optimize(quantization=quantization)
  with disk.new_folder(out) as folder:
    spec.save(folder)
    for path in files:
      shutil.copyfile(path, os.path.join(folder, os.path.basename(path)))


def main(argv: list[str]) -> None:
  parser = cli.OneLineParser(prog='python -m flaxformer_mini.to_ctranslate2',
                             description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--out', required=True,
                      help='the new folder to write the model into.')
  parser.add_argument('--params', choices=['best', 'latest', 'averaged'],
                      default='best')
  parser.add_argument('--quantization', choices=QUANTIZATIONS,
                      default='float32',
                      help="the weights' type (CTranslate2 can also "
                      'quantize when it loads: compute_type).')
  args = parser.parse_args(argv)
  if missing := cli.missing_translation_extras():
    parser.error(missing)
  if importlib.util.find_spec('ctranslate2') is None:
    parser.error("converting needs ctranslate2: pip install -e "
                 "'.[ctranslate2]' (in a clone) or pip install "
                 "'flaxformer_mini[ctranslate2]'.")
  try:
    disk.check_new_folder(args.out)  # before the run is read
  except OSError as e:
    parser.error(cli.out_error(args.out, e))
  # pylint: disable-next=g-import-not-at-top
  from flaxformer_mini import workdir as workdir_lib
  run = cli.load_translation_run(parser, args.workdir, args.params)
  vocabulary = workdir_lib.TOKENIZER + '.model'
  pieces = [run.tokenizer.id_to_piece(i)
            for i in range(run.tokenizer.get_piece_size())]
  try:
    convert(run.params, run.config, pieces, args.out, args.quantization,
            files=(os.path.join(args.workdir, vocabulary),))
  except ConversionError as e:
    parser.error(f'--workdir={args.workdir}: {e}')
  except OSError as e:
    parser.error(cli.out_error(args.out, e))
  print(f'wrote {args.workdir} (step {run.step}, {run.which} parameters) as '
        f'a CTranslate2 model ({args.quantization}) to {args.out}')


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  main(sys.argv[1:])
