"""The bench GRPO steps' fixed prompts: prompts of unequal lengths left-padded with the pad
id, and prompts with images carrying their pixels, grids and mRoPE rows where the data path
puts them (data/image_batch.py)."""

from __future__ import annotations

import torch

from hybridflow.bench.grpo_steps import FixedPrompts
from hybridflow.data.image_batch import IMAGE_GRID_THW, MROPE_POSITIONS, PIXEL_VALUES
from hybridflow.engine.images import PromptImages


def test_text_prompts_of_equal_length_are_the_batch_as_given():
    batch = FixedPrompts([[5, 6, 7], [8, 9, 10]]).next_batch()
    assert batch.tensors["prompts"].tolist() == [[5, 6, 7], [8, 9, 10]]
    assert batch.tensors["attention_mask"].all() and MROPE_POSITIONS not in batch.tensors


def test_prompts_with_images_are_left_padded_with_their_pixels_and_rows():
    pixels = torch.randn(16, 12)
    grid = torch.tensor([[1, 4, 4]])
    rows = torch.tensor([[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]])
    prompts = [[1, 9, 9, 9, 9, 2], [7, 8]]  # an image of 4 tokens, then a text prompt
    batch = FixedPrompts(prompts, [PromptImages(pixels, grid, rows), None], pad_token_id=3)
    got = batch.next_batch()
    assert got.tensors["prompts"].tolist() == [prompts[0], [3, 3, 3, 3, 7, 8]]
    assert got.tensors["attention_mask"][1].tolist() == [0, 0, 0, 0, 1, 1]
    positions = got.tensors[MROPE_POSITIONS]
    assert torch.equal(positions[0], rows)
    assert positions[1, :, 4:].tolist() == [[0, 1]] * 3 and not positions[1, :, :4].any()
    assert got.arrays[PIXEL_VALUES][0] is pixels and got.arrays[PIXEL_VALUES][1].shape == (0, 12)
    assert torch.equal(got.arrays[IMAGE_GRID_THW][0], grid)
    assert got.arrays[IMAGE_GRID_THW][1].shape == (0, 3)
