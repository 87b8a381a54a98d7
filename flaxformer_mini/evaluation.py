"""Evaluation: loss and perplexity on held-out batches, sacreBLEU on text."""

import math

import sacrebleu

from flaxformer_mini.masks import Batch
from flaxformer_mini.parallel import DataParallel


def held_out_loss(parallel: DataParallel, placed_params, batches: list[Batch]):
  """Mean loss per real target token over `batches`, and its perplexity.

  Uses the data-parallel eval_step: metric sums over every device, added up
  exactly over the batches. Returns {'loss', 'perplexity', 'accuracy',
  'tokens'}.
  """
  sums = {'loss_sum': 0.0, 'ntokens': 0, 'correct': 0}
  for batch in batches:
    metrics = parallel.fetch(parallel.eval_step(placed_params,
                                                parallel.put_batch(batch)))
    for key in sums:
      sums[key] += metrics[key]
  tokens = max(int(sums['ntokens']), 1)
  loss = float(sums['loss_sum']) / tokens
  return {'loss': loss, 'perplexity': math.exp(min(loss, 50.0)),
          'accuracy': float(sums['correct']) / tokens,
          'tokens': int(sums['ntokens'])}


def bleu(hypotheses: list[str], references: list[str]) -> tuple[float, str]:
  """Corpus sacreBLEU of detokenized hypotheses against raw references.

  Returns (score, the sacreBLEU signature that says how it was computed).
  """
  metric = sacrebleu.metrics.BLEU()
  score = metric.corpus_score(hypotheses, [references])
  return score.score, str(metric.get_signature())
