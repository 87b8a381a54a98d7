"""flaxformer_mini: the Transformer of "Attention Is All You Need" in Flax.

Figure 1, box by box:
  embeddings.py   input/output embeddings x sqrt(d_model), positional encoding
  attention.py    scaled dot-product attention, multi-head attention (+ cache)
  layers.py       feed-forward, Add & Norm, encoder layer, decoder layer
  model.py        Encoder, Decoder, Transformer (encode / decode)
and around it: config, masks (the Batch), losses, schedules, training (the
pure steps), parallel, loop (the training loop), run (a run's life in its
workdir), checkpoints, workdir, search (greedy and beam search over any
model), decoding (the Transformer's), translation (many sentences on the
host), evaluation, data/ (prepared: a corpus prepared once; prefetch:
batches made ahead), tasks/ (the table of tasks; train_copy,
train_translation), translate (the command), export and to_ctranslate2 (a
trained run for other programs: jax.export, CTranslate2), tour, plots,
logbook, cli, compilation_cache; cpu_kernels is the opt-in CPU seam.

The names below are imported from their modules on first use (PEP 562), so
that `import flaxformer_mini.cli` does not load JAX: the commands refuse a
bad flag, or end on Ctrl-C, before the second it takes.
"""

import importlib as _importlib

# Each public name and the module it lives in.
_HOMES = {
    'Checkpoints': 'checkpoints', 'load_params': 'checkpoints',
    'ConfigError': 'config', 'TransformerConfig': 'config',
    'get_config': 'config',
    'beam_decode': 'decoding', 'greedy_decode': 'decoding',
    'init_cache': 'decoding', 'transformer_tokens_to_logits': 'decoding',
    'sample_decode': 'decoding',
    'Sampling': 'translation', 'translate_lines': 'translation',
    'Batch': 'masks', 'make_batch': 'masks', 'padding_mask': 'masks',
    'target_mask': 'masks',
    'Transformer': 'model',
    'DataParallel': 'parallel',
    'BeamSearchResult': 'search', 'BeamState': 'search',
    'beam_search': 'search', 'beam_search_result': 'search',
    'expand_to_beams': 'search', 'greedy_search': 'search',
    'length_penalty': 'search',
    'run_beam_search': 'search', 'sample_search': 'search',
    'start_beam_search': 'search',
    'take_items': 'search',
    'TrainState': 'training', 'create_train_state': 'training',
    'eval_step': 'training', 'init_params': 'training',
    'train_step': 'training',
    'TrainedRun': 'workdir', 'load_run': 'workdir',
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
  if name not in _HOMES:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  return getattr(_importlib.import_module(f'{__name__}.{_HOMES[name]}'), name)


def __dir__() -> list[str]:
  return __all__
