"""Windowed attention's layout of the vision encoder's tokens."""

import torch

from hybridflow.models.vision.grid import window_order

GRIDS = torch.tensor([[1, 4, 4], [1, 6, 8], [2, 2, 2]])  # patches (t, h, w); merge 2


def test_windows_tile_each_image_and_keep_every_token_once():
    # window 16 px, patch 4, merge 2: 2x2 merged tokens a window
    order, cu_seqlens = window_order(GRIDS, merge=2, window_size=16, patch_size=4)
    assert sorted(order.tolist()) == list(range(4 + 12 + 2))
    # image 1: [0..3] one window; image 2 (3x4 tokens): windows of 4, 4, 2, 2 tokens
    assert order[4:16].tolist() == [4, 5, 8, 9, 6, 7, 10, 11, 12, 13, 14, 15]
    assert cu_seqlens.diff().tolist() == [16, 16, 16, 8, 8, 4, 4]  # in patches (x 4)


def test_a_window_larger_than_every_image_is_one_window_each_without_its_memory():
    """window_size 2**31 - 1 padded each image to a side of 2**28 tokens: an allocation of
    ~2**56 elements that stopped the rollout with an out-of-memory naming other keys."""
    huge = window_order(GRIDS, merge=2, window_size=2**31 - 1, patch_size=4)
    whole = window_order(GRIDS, merge=2, window_size=4 * 2 * 4, patch_size=4)  # 4 tokens a side
    assert all(torch.equal(a, b) for a, b in zip(huge, whole))
    assert huge[1].diff().tolist() == [16, 48, 4, 4]  # each image (each frame) one window
