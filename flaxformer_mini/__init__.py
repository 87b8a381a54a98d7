"""flaxformer_mini: the Transformer of "Attention Is All You Need" in Flax.

Figure 1, box by box:
  embeddings.py   input/output embeddings x sqrt(d_model), positional encoding
  attention.py    scaled dot-product attention, multi-head attention (+ cache)
  layers.py       feed-forward, Add & Norm, encoder layer, decoder layer
  model.py        Encoder, Decoder, Transformer (encode / decode)
  linear.py       the learned linear maps (nn.Dense) inside the boxes
and around it: config, masks (the Batch), losses, schedules, training,
decoding, data/, experiment (the training loop).
"""

from flaxformer_mini.config import ConfigError, TransformerConfig, get_config
from flaxformer_mini.decoding import (BeamSearchResult, beam_decode,
                                      beam_search, greedy_decode,
                                      greedy_search)
from flaxformer_mini.masks import Batch, make_batch
from flaxformer_mini.model import Transformer
from flaxformer_mini.training import (TrainState, create_train_state,
                                      eval_step, init_params, train_step)

__all__ = [
    'Batch', 'BeamSearchResult', 'ConfigError', 'TrainState', 'Transformer',
    'TransformerConfig', 'beam_decode', 'beam_search', 'create_train_state',
    'eval_step', 'get_config', 'greedy_decode', 'greedy_search', 'init_params',
    'make_batch', 'train_step',
]
