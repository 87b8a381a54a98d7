"""The Annotated Transformer (harvardnlp, PyTorch) as the benchmarks' second baseline.

Its code is not part of this project: `load()` fetches
the_annotated_transformer.py at a pinned commit from GitHub once, keeps it in
~/.cache/flaxformer_mini/annotated_transformer/<commit>/, and executes only
the definitions the benchmarks use (the model, its Batch, label smoothing, the
loss compute, `rate` and `greedy_decode`), not the notebook's top level, which
imports spaCy, torchtext and altair and runs its examples.

It is driven the way its own `run_epoch` drives it: forward, SimpleLossCompute
with LabelSmoothing, backward, Adam (betas 0.9 / 0.98, eps 1e-9) with the
LambdaLR `rate` schedule, zero_grad. Same sizes and batches as ours, float32,
PyTorch's own threads (one per core). Its make_model always adds dropout 0.1
on the attention weights, which ours (and the paper) does not. Decoding is its
`greedy_decode`: one sentence at a time, re-running the decoder over the whole
prefix at every step (it has neither a cache nor a beam search).

Needs PyTorch (`pip install torch`); `unavailable()` says why it cannot run.
"""

import ast
import copy
import math
import os
import urllib.request

import numpy as np

# PyTorch's idle threads must sleep, not spin, while JAX's steps run.
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')

COMMIT = '0a91a254735c07532e23733dce8a693e504f3a08'
URL = ('https://raw.githubusercontent.com/harvardnlp/annotated-transformer/'
       f'{COMMIT}/the_annotated_transformer.py')
CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'flaxformer_mini',
                     'annotated_transformer', COMMIT)
NAMES = ('EncoderDecoder', 'Generator', 'clones', 'Encoder', 'LayerNorm',
         'SublayerConnection', 'EncoderLayer', 'Decoder', 'DecoderLayer',
         'subsequent_mask', 'attention', 'MultiHeadedAttention',
         'PositionwiseFeedForward', 'Embeddings', 'PositionalEncoding',
         'make_model', 'Batch', 'rate', 'LabelSmoothing', 'SimpleLossCompute',
         'greedy_decode')


def unavailable() -> str | None:
  """Why the baseline cannot run here, or None."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != 'cpu':
    return 'compared on the CPU only'
  try:
    import torch  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return 'PyTorch is not installed (pip install torch)'
  return None


def load() -> dict:
  """The notebook's definitions (NAMES), by name."""
  import torch  # pylint: disable=g-import-not-at-top
  path = os.path.join(CACHE, 'the_annotated_transformer.py')
  if not os.path.isfile(path):
    os.makedirs(CACHE, exist_ok=True)
    try:
      with urllib.request.urlopen(URL, timeout=60) as response:
        source = response.read()
    except OSError as e:
      raise RuntimeError(
          f'cannot fetch the Annotated Transformer ({e}); offline, put '
          f'{URL} at {path}, or run with --no_baseline.') from e
    with open(path + '.part', 'wb') as f:
      f.write(source)
    os.replace(path + '.part', path)
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  keep = [node for node in tree.body
          if isinstance(node, (ast.FunctionDef, ast.ClassDef))
          and node.name in NAMES]
  missing = set(NAMES) - {node.name for node in keep}
  if missing:
    raise RuntimeError(f'{path} lacks {sorted(missing)}; delete it to fetch '
                       'it again.')
  namespace = {'torch': torch, 'nn': torch.nn, 'math': math, 'copy': copy,
               'log_softmax': torch.nn.functional.log_softmax}
  exec(compile(ast.Module(body=keep, type_ignores=[]), path, 'exec'),  # pylint: disable=exec-used
       namespace)
  return namespace


def make_model(ns: dict, config):
  """Its make_model at our sizes (separate vocabularies, as it has them)."""
  import torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  return ns['make_model'](config.src_vocab_size, config.tgt_vocab_size,
                          N=config.num_encoder_layers, d_model=config.d_model,
                          d_ff=config.d_ff, h=config.num_heads,
                          dropout=config.dropout_rate)


def torch_batch(ns: dict, batch, pad_id: int):
  """Our Batch as its Batch: the full target is tgt_in's bos + tgt_out."""
  import torch  # pylint: disable=g-import-not-at-top
  tgt = np.concatenate([np.asarray(batch.tgt_in)[:, :1],
                        np.asarray(batch.tgt_out)], axis=1)
  return ns['Batch'](torch.from_numpy(np.asarray(batch.src, np.int64)),
                     torch.from_numpy(tgt.astype(np.int64)), pad_id)


def train_step_fn(ns: dict, config):
  """step(their_batch) -> loss: one update as its run_epoch makes it."""
  import torch  # pylint: disable=g-import-not-at-top
  model = make_model(ns, config)
  model.train()
  criterion = ns['LabelSmoothing'](size=config.tgt_vocab_size,
                                   padding_idx=config.pad_id,
                                   smoothing=config.label_smoothing)
  loss_compute = ns['SimpleLossCompute'](model.generator, criterion)
  optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98),
                               eps=1e-9)
  scheduler = torch.optim.lr_scheduler.LambdaLR(
      optimizer, lambda step: ns['rate'](step, config.d_model, 1.0,
                                         config.warmup_steps))

  def step(batch):
    out = model.forward(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    loss, loss_node = loss_compute(out, batch.tgt_y, batch.ntokens)
    loss_node.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return float(loss)

  return step


def greedy_fn(ns: dict, config, gen_len: int):
  """decode(src int64[batch, src_len]) -> [batch, gen_len], its way."""
  import torch  # pylint: disable=g-import-not-at-top
  model = make_model(ns, config)
  model.eval()

  @torch.no_grad()
  def decode(src):
    rows = []
    for sentence in src:
      sentence = sentence[None]
      ys = ns['greedy_decode'](model, sentence,
                               (sentence != config.pad_id).unsqueeze(-2),
                               max_len=gen_len + 1,
                               start_symbol=config.bos_id)
      rows.append(ys[:, 1:])
    return torch.cat(rows)

  return decode
