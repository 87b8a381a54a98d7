import numpy as np

from flaxformer_mini.config import get_config
from flaxformer_mini.masks import causal_mask, make_batch, target_mask


def test_causal_mask_allows_only_the_past_and_present():
  mask = np.asarray(causal_mask(4))[0, 0]
  assert mask.shape == (4, 4)
  for i in range(4):
    for j in range(4):
      assert mask[i, j] == (j <= i)


def test_target_mask_is_padding_and_causal():
  pad = get_config('toy').pad_id
  mask = np.asarray(target_mask(np.array([[1, 5, pad]]), pad))
  assert mask.shape == (1, 1, 3, 3)
  np.testing.assert_array_equal(mask[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 0]])


def test_batch_shifts_the_target_by_one():
  cfg = get_config('toy')
  src = np.array([[5, 6, 7], [8, cfg.pad_id, cfg.pad_id]])
  tgt = np.array([[cfg.bos_id, 5, 6, 7, cfg.eos_id],
                  [cfg.bos_id, 8, cfg.eos_id, cfg.pad_id, cfg.pad_id]])
  batch = make_batch(src, tgt, cfg)
  np.testing.assert_array_equal(batch.tgt_in, tgt[:, :-1])
  np.testing.assert_array_equal(batch.tgt_out, tgt[:, 1:])
  assert batch.src_mask.shape == (2, 1, 1, 3)
  assert batch.tgt_mask.shape == (2, 1, 4, 4)
  np.testing.assert_array_equal(batch.src_mask[:, 0, 0], src != cfg.pad_id)
  # 4 + 2 real tokens in tgt_out (eos counts, pad does not).
  assert int(batch.ntokens) == 6
