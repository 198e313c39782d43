"""Qwen3.5's vision encoder: patches -> one feature row per language-model image token.

What differs from Qwen2.5-VL's (vision/qwen2_5_vl.py, whose attention, 2-D RoPE and patch
grid it reuses): the patch embedding has a bias; a learned square table of positions,
resampled bilinearly (corners aligned) to each image's patch grid, is added to the patch
embeddings; blocks are LayerNorm + attention + an fc1/act/fc2 MLP with biases, attending
over the whole frame in every block (no windows); the merger is LayerNorm, the merge block's
patches concatenated, fc1, GELU, fc2. Parameter names are transformers' (``visual.*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.vision.grid import frame_cu_seqlens, patch_positions, to_device
from hybridflow.models.vision.qwen2_5_vl import (
    NORM_EPS,
    PatchEmbed,
    Segments,
    VisionBlock,
    activation,
    run_blocks,
    vision_rope_cos_sin,
)
from hybridflow.models.vision.spec import VisionSpec


def resampled_positions(table: torch.Tensor, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """The learned positions [side², E] resampled to each image's patch grid (bilinear,
    corners aligned: F.interpolate's), each frame's rows in merge-block order (the patches'
    order in pixel_values), repeated over the frames -> [patches, E]."""
    side = int(round(table.shape[0] ** 0.5))
    square = table.t().reshape(1, -1, side, side)
    out = []
    for t, h, w in grid_thw.tolist():
        grid = F.interpolate(square.float(), size=(h, w), mode="bilinear", align_corners=True)
        grid = grid[0].permute(1, 2, 0)  # [h, w, E]
        blocks = grid.reshape(h // merge, merge, w // merge, merge, -1).transpose(1, 2)
        out.append(blocks.reshape(h * w, -1).repeat(t, 1))
    return torch.cat(out).to(table.dtype)


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)
        self.act = activation(spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """LayerNorm each patch, concatenate each merge block's patches, fc1, GELU, fc2 to the
    language model's width: one row per language-model token."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.merged = spec.hidden_size * spec.merge_unit
        self.norm = layer_norm(spec.hidden_size)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionEncoder(nn.Module):
    """pixel_values [patches, C*T*P*P], image_grid_thw [images, 3] -> image features
    [tokens, out_hidden_size], the images' tokens in order (sum of t*h*w / merge² rows)."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec, bias=True)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(
            VisionBlock(spec, norm=layer_norm, mlp=VisionMLP) for _ in range(spec.depth)
        )
        self.merger = PatchMerger(spec)
        self.gradient_checkpointing = False

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        grid = image_grid_thw.cpu()
        merge = spec.spatial_merge_size
        device = pixel_values.device
        hidden = self.patch_embed(pixel_values)
        hidden = hidden + resampled_positions(self.pos_embed.weight, grid, merge).to(hidden.dtype)
        (positions,) = to_device(device, patch_positions(grid, merge))
        cos, sin = vision_rope_cos_sin(spec, positions)
        frames = Segments.of(frame_cu_seqlens(grid).diff().tolist(), device, hidden.dtype)
        return self.merger(run_blocks(self, hidden, cos, sin, [frames] * len(self.blocks)))


def layer_norm(width: int) -> nn.LayerNorm:
    return nn.LayerNorm(width, eps=NORM_EPS)
