"""flaxformer_mini: the Transformer of "Attention Is All You Need" in Flax.

Figure 1, box by box:
  embeddings.py   input/output embeddings x sqrt(d_model), positional encoding
  attention.py    scaled dot-product attention, multi-head attention (+ cache)
  layers.py       feed-forward, Add & Norm, encoder layer, decoder layer
  model.py        Encoder, Decoder, Transformer (encode / decode)
and around it: config, masks (the Batch), losses, schedules, training (the
pure steps), parallel, loop (the training loop), checkpoints, workdir,
decoding, evaluation, data/, tasks/ (copy, translate), translate (the
command), tour, plots, logbook, compilation_cache; cpu_kernels is the opt-in
CPU seam.
"""

from flaxformer_mini.checkpoints import Checkpoints, load_params
from flaxformer_mini.config import ConfigError, TransformerConfig, get_config
from flaxformer_mini.decoding import (BeamSearchResult, BeamState,
                                      beam_decode, beam_search,
                                      beam_search_result,
                                      continue_beam_decode,
                                      continue_beam_search, expand_to_beams,
                                      greedy_decode, greedy_search,
                                      init_cache, start_beam_decode,
                                      start_beam_search, take_items,
                                      transformer_tokens_to_logits)
from flaxformer_mini.masks import Batch, make_batch
from flaxformer_mini.model import Transformer
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.training import (TrainState, create_train_state,
                                      eval_step, init_params, train_step)

__all__ = [
    'Batch', 'BeamSearchResult', 'BeamState', 'Checkpoints', 'ConfigError',
    'DataParallel', 'TrainState', 'Transformer', 'TransformerConfig',
    'beam_decode', 'beam_search', 'beam_search_result',
    'continue_beam_decode', 'continue_beam_search', 'create_train_state',
    'eval_step', 'expand_to_beams', 'get_config', 'greedy_decode',
    'greedy_search', 'init_cache', 'init_params', 'load_params',
    'make_batch', 'start_beam_decode', 'start_beam_search', 'take_items',
    'train_step', 'transformer_tokens_to_logits',
]
