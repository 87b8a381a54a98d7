"""One frozen configuration for the model and its training, with the presets.

Every module receives the whole config (as in Flax's WMT example) so that no
module grows a long list of keyword arguments. Modes are derived with
`dataclasses.replace`, never by mutation.
"""

import dataclasses
import typing


DTYPES = ('float32', 'bfloat16')
# 'explicit': attention.py's own products, softmax and masks (what the tour
# reads); 'xla' and 'cudnn': jax.nn.dot_product_attention's implementations.
ATTENTION_IMPLEMENTATIONS = ('explicit', 'xla', 'cudnn')
PARALLEL_MODES = ('shard_map', 'pmap')


class ConfigError(ValueError):
  """A configuration value is out of range; the message names the field."""


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters of the Transformer of Figure 1 and of its training.

  The model fields follow the paper's names: N layers (`num_encoder_layers`,
  `num_decoder_layers`), d_model, d_ff, h (`num_heads`), P_drop
  (`dropout_rate`) and eps_ls (`label_smoothing`).
  """

  # Vocabulary and special ids. The ids live here, never as literals in code.
  src_vocab_size: int = 11
  tgt_vocab_size: int = 11
  pad_id: int = 0
  bos_id: int = 1
  eos_id: int = 2

  # The model.
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  max_len: int = 256
  pre_norm: bool = False
  share_embeddings: bool = True
  tie_output_embedding: bool = True
  layer_norm_epsilon: float = 1e-6
  # Activations and matmuls; parameters, optimizer state, layer-norm
  # statistics, softmax and loss stay float32.
  dtype: str = 'float32'
  # Recompute each layer's activations in the backward pass instead of
  # keeping them (jax.checkpoint): far less activation memory for large
  # models and long sentences, for about one more forward pass of compute.
  remat: bool = False
  # Run each stack's layers as one nn.scan over stacked parameters instead
  # of unrolled: one layer's code to compile, whatever the depth. Changes the
  # parameter tree (model.unroll_layers / model.scan_layers convert).
  scan_layers: bool = False
  # How training and evaluation attend (see ATTENTION_IMPLEMENTATIONS):
  # 'cudnn' is the fused flash-attention kernel of NVIDIA GPUs. Decoding and
  # the tensor tour always take the explicit path, whose weights they read.
  attention_implementation: str = 'explicit'

  # The objective and the optimizer.
  label_smoothing: float = 0.1
  lr_factor: float = 1.0
  warmup_steps: int = 4000

  # The training run.
  batch_size: int = 64
  train_steps: int = 100_000
  max_train_minutes: float = 0.0  # stop (and save) after this long; 0 = no limit
  log_every: int = 100
  eval_every: int = 1000
  checkpoint_every: int = 1000  # and at the end; 0 = only at the end
  keep_checkpoints: int = 5     # the last K, plus the best evaluated one
  seed: int = 0
  parallel: str = 'shard_map'  # how the step is mapped over the devices

  # The copy task (source == target, random tokens drawn after the special ids).
  copy_length: int = 10

  # Translation: direction, batches by token budget, the evaluation search.
  src_lang: str = 'de'
  tgt_lang: str = 'en'
  tokens_per_batch: int = 4096  # per side; the paper used about 25,000
  eval_beam_size: int = 4
  eval_alpha: float = 0.6

  def __post_init__(self):
    positive = ('src_vocab_size', 'tgt_vocab_size', 'num_encoder_layers',
                'num_decoder_layers', 'd_model', 'd_ff', 'num_heads',
                'max_len', 'warmup_steps', 'batch_size', 'train_steps',
                'log_every', 'eval_every', 'keep_checkpoints', 'copy_length',
                'tokens_per_batch', 'eval_beam_size')
    for name in positive:
      if getattr(self, name) <= 0:
        raise ConfigError(
            f'--{name}={getattr(self, name)}: must be a positive integer.')
    if self.max_train_minutes < 0:
      raise ConfigError(f'--max_train_minutes={self.max_train_minutes}: must '
                        'be >= 0 (0 = no limit).')
    if self.checkpoint_every < 0:
      raise ConfigError(f'--checkpoint_every={self.checkpoint_every}: must be '
                        '>= 0 (0 saves only at the end).')
    for name in ('dropout_rate', 'attention_dropout_rate', 'label_smoothing'):
      value = getattr(self, name)
      if not 0.0 <= value < 1.0:
        raise ConfigError(f'--{name}={value}: must lie in [0, 1).')
    for name, allowed in (('dtype', DTYPES), ('parallel', PARALLEL_MODES),
                          ('attention_implementation',
                           ATTENTION_IMPLEMENTATIONS)):
      if getattr(self, name) not in allowed:
        raise ConfigError(f'--{name}={getattr(self, name)}: allowed values: '
                          f'{", ".join(allowed)}.')
    fused = self.attention_implementation != 'explicit'
    if fused and self.attention_dropout_rate > 0:
      raise ConfigError(
          f'--attention_implementation={self.attention_implementation} has no '
          'dropout on the attention weights: set --attention_dropout_rate=0 '
          'or --attention_implementation=explicit.')
    if self.attention_implementation == 'cudnn' and self.dtype != 'bfloat16':
      raise ConfigError(
          '--attention_implementation=cudnn: cuDNN fused attention runs in '
          f'bfloat16 only, not --dtype={self.dtype}; set --dtype=bfloat16 or '
          '--attention_implementation=xla.')
    if self.lr_factor <= 0 or self.layer_norm_epsilon <= 0:
      bad = 'lr_factor' if self.lr_factor <= 0 else 'layer_norm_epsilon'
      raise ConfigError(f'--{bad}={getattr(self, bad)}: must be positive.')
    if self.d_model % self.num_heads:
      divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
      raise ConfigError(
          f'--num_heads={self.num_heads}: must divide --d_model='
          f'{self.d_model}; allowed values: {divisors}.')
    special = {'pad_id': self.pad_id, 'bos_id': self.bos_id,
               'eos_id': self.eos_id}
    if len(set(special.values())) != 3:
      raise ConfigError(f'--pad_id, --bos_id, --eos_id must differ: {special}.')
    for name, value in special.items():
      if not 0 <= value < min(self.src_vocab_size, self.tgt_vocab_size):
        raise ConfigError(
            f'--{name}={value}: must lie in [0, vocab size) for both '
            'vocabularies.')
    if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
      raise ConfigError(
          '--share_embeddings=true needs one shared vocabulary, but '
          f'--src_vocab_size={self.src_vocab_size} != --tgt_vocab_size='
          f'{self.tgt_vocab_size}; set --share_embeddings=false.')
    if self.label_smoothing > 0 and self.tgt_vocab_size <= 2:
      raise ConfigError(
          '--label_smoothing > 0 needs --tgt_vocab_size > 2: the smoothing '
          'mass is spread over the tokens that are neither the truth nor pad.')
    if self.src_lang == self.tgt_lang:
      raise ConfigError(f'--src_lang and --tgt_lang are both {self.src_lang}.')
    if self.copy_length + 2 > self.max_len:
      raise ConfigError(
          f'--copy_length={self.copy_length}: with bos and eos it must fit '
          f'in --max_len={self.max_len}.')

  @property
  def d_k(self) -> int:
    """Size of one head's queries, keys and values: d_model / h."""
    return self.d_model // self.num_heads

  def replace(self, **changes) -> 'TransformerConfig':
    return dataclasses.replace(self, **changes)


def _preset_toy() -> TransformerConfig:
  # The walkthrough's model: every tensor is small enough to print.
  return TransformerConfig(
      num_encoder_layers=2, num_decoder_layers=2, d_model=8, d_ff=16,
      num_heads=2, max_len=64, warmup_steps=400, batch_size=2)


def _preset_copy() -> TransformerConfig:
  # Big enough to copy reliably, small enough to converge in seconds on CPU.
  return TransformerConfig(
      num_encoder_layers=2, num_decoder_layers=2, d_model=32, d_ff=64,
      num_heads=4, dropout_rate=0.0, max_len=64, label_smoothing=0.0,
      lr_factor=1.0, warmup_steps=200, batch_size=128, train_steps=3000,
      log_every=50, eval_every=100, checkpoint_every=500)


def _preset_small() -> TransformerConfig:
  # The benchmarks' model: shared vocabulary of 8000, 3 + 3 layers.
  return TransformerConfig(
      src_vocab_size=8000, tgt_vocab_size=8000, num_encoder_layers=3,
      num_decoder_layers=3, d_model=256, d_ff=1024, num_heads=4)


def _preset_base() -> TransformerConfig:
  return TransformerConfig(src_vocab_size=32000, tgt_vocab_size=32000)


def _preset_big() -> TransformerConfig:
  return TransformerConfig(
      src_vocab_size=32000, tgt_vocab_size=32000, d_model=1024, d_ff=4096,
      num_heads=16, dropout_rate=0.3)


def _preset_translate() -> TransformerConfig:
  # Multi30k-sized: the `small` model with dropout, trainable on a CPU.
  return _preset_small().replace(
      max_len=128, tokens_per_batch=6000, warmup_steps=2000, train_steps=20000,
      log_every=100, eval_every=2000, checkpoint_every=1000)


PRESETS: dict[str, typing.Callable[[], TransformerConfig]] = {
    'toy': _preset_toy,
    'copy': _preset_copy,
    'translate': _preset_translate,
    'small': _preset_small,
    'base': _preset_base,
    'big': _preset_big,
}


def get_config(name: str) -> TransformerConfig:
  """Returns the preset `name` (one of PRESETS)."""
  if name not in PRESETS:
    raise ConfigError(
        f'--config={name}: unknown preset; allowed values: '
        f'{", ".join(PRESETS)}.')
  return PRESETS[name]()


def field_types() -> dict[str, type]:
  """The type of every config field, for parsing command-line strings."""
  hints = typing.get_type_hints(TransformerConfig)
  return {f.name: hints[f.name] for f in dataclasses.fields(TransformerConfig)}


def _parse_value(name: str, kind: type, text: str):
  if kind is bool:
    lowered = text.strip().lower()
    if lowered in ('1', 'true', 'yes'):
      return True
    if lowered in ('0', 'false', 'no'):
      return False
    raise ConfigError(f'--{name}={text}: allowed values: true, false.')
  try:
    return kind(text)
  except ValueError:
    raise ConfigError(
        f'--{name}={text}: expected a value of type {kind.__name__}.') from None


def override(config: TransformerConfig,
             overrides: dict[str, str]) -> TransformerConfig:
  """Applies command-line strings {field: text} to `config`, validating them.

  Raises:
    ConfigError: naming the unknown field or the bad value.
  """
  types = field_types()
  unknown = sorted(set(overrides) - set(types))
  if unknown:
    raise ConfigError(
        f'--{unknown[0]}: unknown config field; allowed fields: '
        f'{", ".join(types)}.')
  parsed = {name: _parse_value(name, types[name], text)
            for name, text in overrides.items()}
  return dataclasses.replace(config, **parsed)
