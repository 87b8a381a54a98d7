"""One frozen configuration for the model and its training, with the presets.

Every module receives the whole config (as in Flax's WMT example) so that no
module grows a long list of keyword arguments. Modes are derived with
`config.replace(...)`, never by mutation. Fields that only one task reads
(the copy task's `copy_length`, translation's languages and token budget)
are checked by that task when it starts (`tasks/`), not here.
"""

import dataclasses
import math


DTYPES = ('float32', 'bfloat16')
# The string fields and what each may be. With the boolean fields they are
# the config's switches (`switches()`), which the property tests sweep: a
# new choice is tested by adding it here.
CHOICES = {'dtype': DTYPES}
# When a sentence's beam search ends (search.beam_search says how each
# decides); not a switch of the model, so not in CHOICES.
STOPPING_RULES = ('exact', 'beam_finished', 'current_length')
# The library's and a new run's rule (eval_stopping below says why).
DEFAULT_STOPPING = 'current_length'


class ConfigError(ValueError):
  """A configuration value is out of range.

  The message starts with the field and its value (`num_heads=3: ...`);
  train.py shows it as the flag of the same name.
  """


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
  dropout_rate: float = 0.1            # sublayer outputs, embeddings + positions
  attention_dropout_rate: float = 0.0  # the attention weights
  relu_dropout_rate: float = 0.0       # the feed-forward block's hidden layer
  max_len: int = 256
  pre_norm: bool = False
  share_embeddings: bool = True
  tie_output_embedding: bool = True
  layer_norm_epsilon: float = 1e-6
  # Activations and matmuls (every product accumulating in float32);
  # parameters, optimizer state, layer-norm statistics, softmax, the tied
  # output layer's logits and the loss stay float32.
  dtype: str = 'float32'
  # Recompute each layer's activations in the backward pass instead of
  # keeping them (jax.checkpoint): far less activation memory for large
  # models and long sentences, for about one more forward pass of compute.
  remat: bool = False
  # The training step's products in the form XLA's CPU backend runs fastest
  # (cpu_kernels.py); the same values. For CPU runs only.
  cpu_kernels: bool = False

  # The objective and the optimizer.
  label_smoothing: float = 0.1
  lr_factor: float = 1.0
  warmup_steps: int = 4000
  # The last cooldown_steps of train_steps take the rate linearly down to 0
  # (0 = the paper's schedule to the end).
  cooldown_steps: int = 0

  # The training run.
  batch_size: int = 64
  # Each update sums the gradients of this many micro-batches, each 1/N of
  # the batch: the update of the whole batch in the memory of one
  # micro-batch, so the paper's batch fits on fewer devices.
  grad_accumulation: int = 1
  train_steps: int = 100_000
  max_train_minutes: float = 0.0  # stop (and save) after this long; 0 = no limit
  log_every: int = 100
  eval_every: int = 1000
  checkpoint_every: int = 1000  # and at the end; 0 = only at the end
  keep_checkpoints: int = 5     # the last K, plus the best evaluated one
  # Translation: average the parameters of the last N checkpoints at the end
  # (0 or 1: no averaging) and keep whichever of them and the last scores
  # better on validation.
  average_last: int = 0
  seed: int = 0

  # The copy task (source == target, random tokens drawn after the special ids).
  copy_length: int = 10

  # Translation: direction, batches by token budget, the evaluation search.
  src_lang: str = 'de'
  tgt_lang: str = 'en'
  # Per side, over every device and host (the global batch); the paper used
  # about 25,000.
  tokens_per_batch: int = 4096
  # The joint vocabulary is trained on a seeded random sample of this many
  # training pairs (0: all of them, up to 1,000,000).
  vocab_sample: int = 0
  eval_beam_size: int = 4
  eval_alpha: float = 0.6
  # The beam search's stopping rule in evaluations, the translate command
  # and the export (STOPPING_RULES). 'current_length' by measurement: on the
  # en->de recipe it returned the exact rule's translation for all but one
  # or two sentences in a thousand (BLEU within 0.02 on test and
  # validation, beams 4 and 5) and searched 1.3-1.4x faster; beam_finished
  # was as fast but lost 0.09-0.16 BLEU on validation at beam 4
  # (benchmarks/stopping_rules.py, docs/performance.md "Stopping rules").
  # A run saved before this field existed decoded with 'exact' and keeps it
  # (checkpoints.saved_config).
  eval_stopping: str = DEFAULT_STOPPING

  def __post_init__(self):
    positive = ('src_vocab_size', 'tgt_vocab_size', 'num_encoder_layers',
                'num_decoder_layers', 'd_model', 'd_ff', 'num_heads',
                'max_len', 'warmup_steps', 'batch_size', 'train_steps',
                'log_every', 'eval_every', 'keep_checkpoints', 'copy_length',
                'tokens_per_batch', 'eval_beam_size', 'grad_accumulation')
    for name in positive:
      _check(getattr(self, name) > 0, name, self, 'must be a positive integer')
    for name in ('checkpoint_every', 'seed', 'average_last', 'cooldown_steps',
                 'vocab_sample'):
      _check(getattr(self, name) >= 0, name, self, 'must be >= 0')
    _check(self.cooldown_steps <= self.train_steps, 'cooldown_steps', self,
           f'must not exceed train_steps={self.train_steps}')
    _check(math.isfinite(self.max_train_minutes) and
           self.max_train_minutes >= 0, 'max_train_minutes', self,
           'must be >= 0 (0 = no limit)')
    for name in ('dropout_rate', 'attention_dropout_rate', 'relu_dropout_rate',
                 'label_smoothing'):
      _check(0.0 <= getattr(self, name) < 1.0, name, self, 'must lie in [0, 1)')
    for name in ('lr_factor', 'layer_norm_epsilon'):
      value = getattr(self, name)
      _check(math.isfinite(value) and value > 0, name, self,
             'must be a positive finite number')
    _check(math.isfinite(self.eval_alpha), 'eval_alpha', self,
           'must be a finite number')
    _check(self.eval_stopping in STOPPING_RULES, 'eval_stopping', self,
           f'allowed values: {", ".join(STOPPING_RULES)}')
    for name, allowed in CHOICES.items():
      _check(getattr(self, name) in allowed, name, self,
             f'allowed values: {", ".join(allowed)}')
    divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
    _check(self.d_model % self.num_heads == 0, 'num_heads', self,
           f'must divide d_model={self.d_model}; allowed values: {divisors}')
    special = {'pad_id': self.pad_id, 'bos_id': self.bos_id,
               'eos_id': self.eos_id}
    if len(set(special.values())) != 3:
      raise ConfigError(f'pad_id, bos_id, eos_id must differ: {special}.')
    for name in special:
      _check(0 <= getattr(self, name) < min(self.src_vocab_size,
                                            self.tgt_vocab_size),
             name, self, 'must lie in [0, vocab size) for both vocabularies')
    _check(not self.share_embeddings or
           self.src_vocab_size == self.tgt_vocab_size, 'share_embeddings',
           self, 'needs one shared vocabulary, but src_vocab_size='
           f'{self.src_vocab_size} != tgt_vocab_size={self.tgt_vocab_size}; '
           'set share_embeddings=false')
    _check(self.label_smoothing == 0 or self.tgt_vocab_size > 2,
           'label_smoothing', self, 'needs tgt_vocab_size > 2: the smoothing '
           'mass is spread over the tokens that are neither the truth nor pad')

  @property
  def first_ordinary_id(self) -> int:
    """The smallest id that is not a special one (pad, bos, eos)."""
    return max(self.pad_id, self.bos_id, self.eos_id) + 1

  @property
  def d_k(self) -> int:
    """Size of one head's queries, keys and values: d_model / h."""
    return self.d_model // self.num_heads

  def replace(self, **changes) -> 'TransformerConfig':
    return dataclasses.replace(self, **changes)


def _check(holds: bool, name: str, config: TransformerConfig, why: str):
  if not holds:
    raise ConfigError(f'{name}={getattr(config, name)}: {why}.')


_BASE = TransformerConfig()

PRESETS: dict[str, TransformerConfig] = {
    # The walkthrough's model: every tensor is small enough to print. With
    # batches of 64 it learns the walkthrough's two-token copy ("dog run").
    'toy': _BASE.replace(
        num_encoder_layers=2, num_decoder_layers=2, d_model=8, d_ff=16,
        num_heads=2, max_len=64, warmup_steps=400, batch_size=64,
        dropout_rate=0.0, label_smoothing=0.0, copy_length=2, train_steps=3000,
        log_every=50, eval_every=100, checkpoint_every=500),
    # Big enough to copy reliably, small enough to converge in seconds on CPU.
    # Half the Noam rate: at d_model 32 the full one peaks at 0.0125, and
    # exact match then collapses and recovers on the way. The paper's label
    # smoothing stays: without it the loss falls towards 0, and so do the
    # gradients and Adam's second moments, until one ordinary batch makes a
    # step large enough to undo hundreds (exact match 1.0 -> 0.87); the run
    # then stops on parameters that still miscopy (docs/copy-task.md).
    'copy': _BASE.replace(
        num_encoder_layers=2, num_decoder_layers=2, d_model=32, d_ff=64,
        num_heads=4, dropout_rate=0.0, max_len=64, lr_factor=0.5,
        warmup_steps=200, batch_size=128, train_steps=3000, log_every=50,
        eval_every=100, checkpoint_every=500),
    # The benchmarks' model: shared vocabulary of 8000, 3 + 3 layers.
    'small': _BASE.replace(
        src_vocab_size=8000, tgt_vocab_size=8000, num_encoder_layers=3,
        num_decoder_layers=3, d_model=256, d_ff=1024, num_heads=4),
    # Multi30k's recipe for a CPU hour: the model of the Transformer-Tiny of
    # Wu et al. (ACL 2021), the best published text-only model trained from
    # scratch on these 29,000 pairs: 4 + 4 layers of d_model 128, d_ff 256, 4
    # heads, one joint 10k vocabulary, its 8,000 updates, beam 5; 2.6M
    # parameters. Its dropout 0.3 and peak learning rate of 0.005 learn too
    # slowly for the steps a 2-core CPU makes in an hour (greedy validation
    # BLEU 10 after 2,000 steps); dropout 0.1 and a peak of 0.0022 reach that
    # in a quarter of the tokens. Batches of 2,048 tokens, half Wu et al.'s,
    # make twice the updates of the same tokens and learn more from each
    # token; warm-up and checkpoint spacing are doubled to keep their tokens,
    # and lr_factor 0.707 (0.5 * sqrt 2) keeps the peak at 0.0022.
    # The last 5 checkpoints are averaged at the end (10 averaged more of a
    # still-changing model and scored lower), and beam 5 decodes with alpha
    # 1.0, which beat 0.6 on validation (docs/multi30k.md: runs 4, 6, 7).
    'multi30k': _BASE.replace(
        src_vocab_size=10000, tgt_vocab_size=10000, num_encoder_layers=4,
        num_decoder_layers=4, d_model=128, d_ff=256, num_heads=4,
        dropout_rate=0.1, max_len=128, tokens_per_batch=2048, lr_factor=0.707,
        warmup_steps=800, train_steps=8000, log_every=100, eval_every=1000,
        checkpoint_every=200, keep_checkpoints=5, average_last=5,
        eval_beam_size=5, eval_alpha=1.0),
    # The `small` model with dropout and 6,000 tokens per batch: the earlier
    # Multi30k recipe (docs/multi30k.md), a wider model for the notebook.
    'translate': _BASE.replace(
        src_vocab_size=8000, tgt_vocab_size=8000, num_encoder_layers=3,
        num_decoder_layers=3, d_model=256, d_ff=1024, num_heads=4,
        max_len=128, tokens_per_batch=6000, warmup_steps=2000,
        train_steps=20000, log_every=100, eval_every=2000,
        checkpoint_every=1000),
    # The paper's base and big models (Table 3), with a 32k shared vocabulary.
    'base': _BASE.replace(src_vocab_size=32000, tgt_vocab_size=32000),
    # The paper's own run (Section 5, Table 2): the base model on WMT 2014
    # English -> German, one shared vocabulary of about 37,000 pieces
    # (trained on a seeded sample of 1M pairs), batches of about 25,000
    # source and 25,000 target tokens (global: with fewer devices than the
    # paper's 8, add --grad_accumulation), 100,000 steps with 4,000 of
    # warm-up, the average of the last 5 checkpoints (the paper wrote them
    # every 10 minutes, about 1,500 steps), beam 4 with alpha 0.6
    # (docs/wmt14.md).
    'wmt14': _BASE.replace(
        src_lang='en', tgt_lang='de', src_vocab_size=37000,
        tgt_vocab_size=37000, max_len=256,
        tokens_per_batch=25000, train_steps=100_000, warmup_steps=4000,
        log_every=100, eval_every=5000, checkpoint_every=1500,
        keep_checkpoints=5, average_last=5, eval_beam_size=4,
        eval_alpha=0.6),
    'big': _BASE.replace(
        src_vocab_size=32000, tgt_vocab_size=32000, d_model=1024, d_ff=4096,
        num_heads=16, dropout_rate=0.3),
}


def switches() -> dict[str, tuple]:
  """Every switch of the config and the values it takes: each string field of
  CHOICES and each boolean field, {name: values}."""
  booleans = {field.name: (False, True)
              for field in dataclasses.fields(TransformerConfig)
              if field.type in (bool, 'bool')}
  return {**CHOICES, **booleans}


def get_config(name: str) -> TransformerConfig:
  """Returns the preset `name` (one of PRESETS)."""
  if name not in PRESETS:
    raise ConfigError(f'config={name}: unknown preset; allowed values: '
                      f'{", ".join(PRESETS)}.')
  return PRESETS[name]
