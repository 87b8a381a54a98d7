"""Evaluation: loss and perplexity on held-out batches, sacreBLEU on text."""

import math

import sacrebleu

from flaxformer_mini.masks import Batch
from flaxformer_mini.parallel import DataParallel


def held_out_loss(parallel: DataParallel, placed_params,
                  batches: list[Batch]) -> dict:
  """Mean loss per real target token over `batches`, and its perplexity.

  placed_params: the parameters as `parallel.replicate` placed them. Uses the
  data-parallel eval_step: metric sums over every device, added up exactly
  over the batches. Returns {'loss', 'perplexity', 'accuracy', 'tokens'}.
  """
  sums = {'loss_sum': 0.0, 'ntokens': 0, 'correct': 0}
  for batch in batches:
    metrics = parallel.to_host(parallel.eval_step(placed_params,
                                                parallel.put_batch(batch)))
    for key in sums:
      sums[key] += metrics[key]
  tokens = max(int(sums['ntokens']), 1)
  loss = float(sums['loss_sum']) / tokens
  return {'loss': loss, 'perplexity': math.exp(min(loss, 50.0)),
          'accuracy': float(sums['correct']) / tokens,
          'tokens': int(sums['ntokens'])}


def bleu(hypotheses: list[str], references: list[str]) -> dict:
  """Corpus sacreBLEU of detokenized hypotheses against the raw references.

  Returns {'bleu': cased BLEU, 'bleu_lowercase': the same on lowercased text
  (what Multi30k papers report), 'signature', 'signature_lowercase'}: each
  signature says exactly how its score was computed (tokenizer 13a).
  """
  scores = {}
  for key, lowercase in (('', False), ('_lowercase', True)):
    metric = sacrebleu.metrics.BLEU(lowercase=lowercase)
    scores['bleu' + key] = metric.corpus_score(hypotheses, [references]).score
    scores['signature' + key] = str(metric.get_signature())
  return scores
