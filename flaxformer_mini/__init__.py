"""flaxformer_mini: the Transformer of "Attention Is All You Need" in Flax.

Figure 1, box by box:
  embeddings.py   input/output embeddings x sqrt(d_model), positional encoding
  attention.py    scaled dot-product attention, multi-head attention (+ cache)
  layers.py       feed-forward, Add & Norm, encoder layer, decoder layer
  model.py        Encoder, Decoder, Transformer (encode / decode)
and around it: config, masks (the Batch), losses, schedules, training (the
pure steps), parallel, loop (the training loop), checkpoints, workdir,
search (greedy and beam search over any model), decoding (the Transformer's),
evaluation, data/, tasks/ (copy, translate), translate (the command), tour,
plots, logbook, compilation_cache; cpu_kernels is the opt-in CPU seam.
"""

from flaxformer_mini.checkpoints import Checkpoints, load_params
from flaxformer_mini.config import ConfigError, TransformerConfig, get_config
from flaxformer_mini.decoding import (beam_decode, greedy_decode, init_cache,
                                      transformer_tokens_to_logits,
                                      translate_lines)
from flaxformer_mini.masks import Batch, make_batch
from flaxformer_mini.model import Transformer
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.search import (BeamSearchResult, BeamState, beam_search,
                                    beam_search_result, expand_to_beams,
                                    greedy_search, run_beam_search,
                                    start_beam_search, take_items)
from flaxformer_mini.training import (TrainState, create_train_state,
                                      eval_step, init_params, train_step)
from flaxformer_mini.workdir import TrainedRun, load_run

__all__ = [
    'Batch', 'BeamSearchResult', 'BeamState', 'Checkpoints', 'ConfigError',
    'DataParallel', 'TrainState', 'TrainedRun', 'Transformer',
    'TransformerConfig', 'beam_decode', 'beam_search', 'beam_search_result',
    'create_train_state', 'eval_step', 'expand_to_beams', 'get_config',
    'greedy_decode', 'greedy_search', 'init_cache', 'init_params',
    'load_params', 'load_run', 'make_batch', 'run_beam_search',
    'start_beam_search', 'take_items', 'train_step',
    'transformer_tokens_to_logits', 'translate_lines',
]
