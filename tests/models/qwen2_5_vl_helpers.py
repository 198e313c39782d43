"""A tiny random Qwen2.5-VL written by transformers, and a batch with images: two prompts
with images of different sizes (one with two images) and a text-only row, left-padded."""

from __future__ import annotations

import torch

VOCAB = 300
IMAGE, VIDEO, START, END = 290, 291, 292, 293
PATCH, MERGE, TEMPORAL = 4, 2, 2


def tiny_config(tie: bool = False):
    from transformers import Qwen2_5_VLConfig

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)  # fmt: skip
    # windows of 2x2 merged tokens: the 6x8-patch image spans several, cut at its edges
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                  out_hidden_size=64, patch_size=PATCH, spatial_merge_size=MERGE,
                  temporal_patch_size=TEMPORAL, window_size=16,
                  fullatt_block_indexes=[1])  # fmt: skip
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                            video_token_id=VIDEO, vision_start_token_id=START,
                            vision_end_token_id=END, tie_word_embeddings=tie)  # fmt: skip


def transformers_model(tie: bool = False):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(tie)).eval()
    with torch.no_grad():  # random norms and biases: a load that misses one shows
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def _image_run(grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    return [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]


def image_batch():
    """(input_ids [3, T], attention_mask, pixel_values [patches, C*T*P*P],
    image_grid_thw [3, 3], mm_token_type_ids): row 0 one 4x4-patch image, row 1 two
    images (6x8 and 2x2 patches) with text between and after, row 2 text only."""
    grids = [(1, 4, 4), (1, 6, 8), (1, 2, 2)]
    rows = [
        [5, 6] + _image_run(grids[0]) + [7, 8, 9],
        [10] + _image_run(grids[1]) + [11, 12] + _image_run(grids[2]) + [13, 14, 15, 16],
        [17, 18, 19, 20, 21],
    ]
    length = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):  # left padding, as a rollout's prompts
        ids[i, length - len(row) :] = torch.tensor(row)
        mask[i, length - len(row) :] = 1
    grid = torch.tensor(grids)
    patches = int(grid.prod(-1).sum())
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randn(patches, 3 * TEMPORAL * PATCH * PATCH, generator=generator)
    types = (ids == IMAGE).long()
    return ids, mask, pixels, grid, types
