"""Qwen2.5-VL's vision encoder: patches -> one feature row per language-model image token.

patch embedding (a linear map of each flattened C x T x P x P patch: the stride-equals-kernel
Conv3d of transformers' file, as one matmul), blocks of RMSNorm + attention + SwiGLU MLP with
biases, attention within windows except on fullatt_block_indexes (there within each frame),
2-D RoPE (each head's first half turned by the patch's row, its second by its column), then
the merger: RMSNorm, spatial_merge_size² neighbouring patches concatenated, an MLP to the
language model's width. Parameter names are transformers' (``visual.*`` of a checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.attention import flash_varlen_attention
from hybridflow.models.norm import RMSNorm
from hybridflow.models.rope import rotate_half
from hybridflow.models.vision.grid import (
    frame_cu_seqlens,
    patch_positions,
    to_device,
    window_order,
)
from hybridflow.models.vision.spec import VisionSpec

NORM_EPS = 1e-6
FLASH_DTYPES = (torch.bfloat16, torch.float16)  # segment_attention's flash kernel


def activation(name: str):
    """HF's activation of that name (vision_config.hidden_act)."""
    return {"silu": F.silu, "gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
            "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}[name]  # fmt: skip


def vision_rope_cos_sin(
    spec: VisionSpec, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N, 2] (row, column) -> cos, sin [N, head_dim] in fp32: a quarter of the
    head's frequencies for the row, a quarter for the column, the pair repeated (rotate_half
    layout)."""
    quarter = spec.head_dim // 2
    exponents = torch.arange(0, quarter, 2, dtype=torch.float32, device=positions.device) / quarter
    inv_freq = 1.0 / spec.rope_theta**exponents  # [head_dim // 4]
    freqs = (positions.float().unsqueeze(-1) * inv_freq).flatten(1)  # [N, head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


class PatchEmbed(nn.Module):
    """``proj.weight`` [E, C, T, P, P] as transformers stores its Conv3d (and ``proj.bias``
    [E] where it has one: Qwen3.5's); applied to pixel_values rows [N, C*T*P*P] as the one
    matmul that convolution amounts to."""

    def __init__(self, spec: VisionSpec, bias: bool = False):
        super().__init__()
        self.proj = nn.Module()
        shape = (spec.hidden_size, spec.in_channels, spec.temporal_patch_size,
                 spec.patch_size, spec.patch_size)  # fmt: skip
        self.proj.weight = nn.Parameter(torch.empty(shape))
        self.proj.bias = nn.Parameter(torch.empty(spec.hidden_size)) if bias else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.flatten(1), self.proj.bias)


@dataclass(frozen=True)
class Segments:
    """Where attention's segments (windows or frames) are: their lengths; on CUDA the same
    as cu_seqlens for the flash kernel (one launch for all of them); and for SDPA the
    segments grouped by length (equal_length_groups), built once for all the blocks."""

    lengths: list[int]
    cu_seqlens: torch.Tensor | None = None
    groups: EqualLengthGroups | None = None

    @classmethod
    def of(cls, lengths: list[int], device: torch.device,
           dtype: torch.dtype | None = None) -> Segments:  # fmt: skip
        """What segment_attention reads for activations of ``dtype`` on ``device``: the
        flash kernel's cu_seqlens or SDPA's groups (None: both)."""
        flash = device.type == "cuda" and dtype in (None, *FLASH_DTYPES)
        cu = groups = None
        if flash:
            cu = torch.tensor([0, *lengths]).cumsum(0)
            cu = to_device(device, cu)[0].to(torch.int32)
        if dtype is None or not flash:
            groups = equal_length_groups(lengths, device)
        return cls(lengths, cu, groups)


@dataclass(frozen=True)
class EqualLengthGroups:
    """The segments of each distinct length, as one batch of SDPA: lengths [G], index
    [S_g, length] of each group's tokens (row by row: its segments), and inverse [N]: where
    each token's output lies in the groups' outputs concatenated."""

    lengths: list[int]
    index: list[torch.Tensor]
    inverse: torch.Tensor


def equal_length_groups(lengths: list[int], device: torch.device) -> EqualLengthGroups:
    """A window layout has a few distinct lengths (a full window, one cut at the right edge,
    at the bottom, at the corner, per image size): attention runs once a length instead of
    once a window (a 448 x 448 image has 16 windows in each of 28 windowed blocks at 7B)."""
    sizes = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    distinct = sorted(set(lengths))
    index = [starts[sizes == n][:, None] + torch.arange(n) for n in distinct]
    order = torch.cat([i.flatten() for i in index]) if index else sizes.new_zeros(0)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    *index, inverse = to_device(device, *index, inverse)
    return EqualLengthGroups(distinct, index, inverse)


def segment_attention(q, k, v, segments: Segments) -> torch.Tensor:
    """Bidirectional attention within each segment: q, k, v [N, heads, d] -> [N, heads, d].
    FlashAttention's varlen kernel (bf16/fp16 on CUDA), else SDPA, one batched call for the
    segments of each length."""
    if segments.cu_seqlens is not None and q.dtype in FLASH_DTYPES:
        return flash_varlen_attention(q, k, v, segments.cu_seqlens, max(segments.lengths),
                                      deterministic=True, causal=False)  # fmt: skip
    groups = segments.groups or equal_length_groups(segments.lengths, q.device)
    out = []
    for index in groups.index:  # [S, L, heads, d] -> [S, heads, L, d] and back
        batch = (t[index].transpose(1, 2) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(*batch).transpose(1, 2).flatten(0, 1))
    return torch.cat(out)[groups.inverse]


class VisionAttention(nn.Module):
    """Bidirectional attention within segments (windows or frames), 2-D RoPE in fp32."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=True)

    def forward(self, x, cos, sin, segments: Segments) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)  # [N, h, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        return self.proj(segment_attention(q, k, v, segments).flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        e, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(e, i, bias=True)
        self.up_proj = nn.Linear(e, i, bias=True)
        self.down_proj = nn.Linear(i, e, bias=True)
        self.act = activation(spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """norm1, attention, norm2, MLP, each with its residual: RMSNorm and the SwiGLU MLP, or
    the ``norm`` (a module of the width) and ``mlp`` (of the spec) another kind gives."""

    def __init__(self, spec: VisionSpec, norm=None, mlp=None):
        super().__init__()
        norm = norm or (lambda width: RMSNorm(width, NORM_EPS))
        self.norm1 = norm(spec.hidden_size)
        self.norm2 = norm(spec.hidden_size)
        self.attn = VisionAttention(spec)
        self.mlp = (mlp or VisionMLP)(spec)

    def forward(self, x, cos, sin, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate each merge block's patches, MLP (GELU) to the
    language model's width: one row per language-model token."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.merged = spec.hidden_size * spec.merge_unit
        self.ln_q = RMSNorm(spec.hidden_size, NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, spec.out_hidden_size))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


class VisionEncoder(nn.Module):
    """pixel_values [patches, C*T*P*P], image_grid_thw [images, 3] -> image features
    [tokens, out_hidden_size], the images' tokens in order (sum of t*h*w / merge² rows)."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)
        self.gradient_checkpointing = False

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        grid = image_grid_thw.cpu()
        order, window_cu = window_order(grid, spec.spatial_merge_size, spec.window_size,
                                        spec.patch_size)  # fmt: skip
        unit = spec.merge_unit

        def windowed(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
            return t.unflatten(0, (-1, unit))[order].flatten(0, 1)  # each window's patches

        positions = windowed(patch_positions(grid, spec.spatial_merge_size), order)
        device = pixel_values.device
        order, unorder, positions = to_device(device, order, torch.argsort(order), positions)
        hidden = windowed(self.patch_embed(pixel_values), order)
        cos, sin = vision_rope_cos_sin(spec, positions)
        # the full blocks attend within each frame, the others within each window (the
        # windows nest in the frames, so one permutation serves both)
        dtype = hidden.dtype
        frames = Segments.of(frame_cu_seqlens(grid).diff().tolist(), device, dtype)
        windows = Segments.of(window_cu.diff().tolist(), device, dtype)
        segments = [frames if i in spec.fullatt_block_indexes else windows
                    for i in range(len(self.blocks))]  # fmt: skip
        return self.merger(run_blocks(self, hidden, cos, sin, segments))[unorder]


def run_blocks(encoder: nn.Module, hidden, cos, sin, segments: list[Segments]) -> torch.Tensor:
    """encoder.blocks in turn over hidden, block i attending within segments[i]; each block
    recomputed in the backward when the encoder trains under gradient checkpointing."""
    recompute = encoder.gradient_checkpointing and encoder.training and torch.is_grad_enabled()
    for block, within in zip(encoder.blocks, segments):
        if recompute:
            hidden = torch.utils.checkpoint.checkpoint(
                block, hidden, cos, sin, within, use_reentrant=False
            )
        else:
            hidden = block(hidden, cos, sin, within)
    return hidden
