"""Gated DeltaNet layers split by heads: Ulysses sequence parallelism (and the head
arithmetic a tensor-parallel split shares).

Everything a Gated DeltaNet layer does along a sequence (the causal depthwise conv over its
q/k/v channels, the L2 norms, the gates, the delta rule) is separate per key head and the
value heads it serves (key head h serves value heads h*G .. h*G + G - 1). So, as attention
does under Ulysses (models/sharding/sequence_parallel.py), one all-to-all after the
in-projections trades this rank's slice of the stream for all tokens of 1/SP of the key
heads with their value heads, the ordinary packed mixing runs over the whole stream (the
same ``cu_seqlens``: no state and no conv tap crosses a sequence boundary, the pad sequence
included), and a second all-to-all trades the output heads back before the gated norm and
out_proj. What a rank exchanges per layer and token: its q, k, v channels and the two gate
inputs (one all-to-all), then the output heads: ``(2 Hk Dk + Hv Dv + 2 Hv) + Hv Dv`` values.

The projections' outputs travel, not the gates: the decay is computed after the exchange
from the rank's slices of A_log and dt_bias, in fp32 as in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybridflow.models.mixers.token_layout import HeadWeights, TokenLayout
from hybridflow.models.sharding.sequence_parallel import heads_to_tokens, tokens_to_heads

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class HeadShape:
    """Some of a layer's heads: ``key_heads`` key heads of ``key_dim`` channels, each serving
    ``group`` value heads of ``value_dim`` channels."""

    key_heads: int
    group: int
    key_dim: int
    value_dim: int

    @property
    def value_heads(self) -> int:
        return self.key_heads * self.group

    @classmethod
    def of(cls, mixer: nn.Module, channels: int, value_heads: int) -> HeadShape:
        """The heads behind in_proj_qkv's ``channels`` outputs and ``value_heads`` gate
        outputs (all of the layer's, or a tensor-parallel rank's)."""
        key_channels = (channels - value_heads * mixer.head_v_dim) // 2
        key_heads = key_channels // mixer.head_k_dim
        if key_heads < 1 or value_heads % key_heads:
            raise ValueError(f"{channels} q/k/v channels and {value_heads} value heads are not "
                             "whole key heads with their value heads")  # fmt: skip
        return cls(key_heads, value_heads // key_heads, mixer.head_k_dim, mixer.head_v_dim)


def head_channels(shape: HeadShape, first: int, count: int) -> torch.Tensor:
    """The q/k/v channels (rows of in_proj_qkv and of the conv, [q; k; v] order) of key heads
    ``first .. first + count - 1`` and their value heads, in that order (pure)."""
    key_width = shape.key_heads * shape.key_dim
    q = torch.arange(first * shape.key_dim, (first + count) * shape.key_dim)
    v_first, v_count = first * shape.group * shape.value_dim, count * shape.group * shape.value_dim
    v = torch.arange(v_first, v_first + v_count) + 2 * key_width
    return torch.cat([q, q + key_width, v])


def rank_weights(weights: HeadWeights, shape: HeadShape, rank: int, size: int) -> HeadWeights:
    """The slices of ``weights`` that rank ``rank`` of ``size`` needs for its key heads (a
    contiguous 1/size of them) and their value heads. Differentiable: the other heads' rows
    get a zero gradient here, and the sum over ranks (FSDP's reduce) is the whole one."""
    count = shape.key_heads // size
    channels = head_channels(shape, rank * count, count).to(weights.conv.device)
    heads = slice(rank * count * shape.group, (rank + 1) * count * shape.group)
    return replace(weights, conv=weights.conv[channels], A_log=weights.A_log[heads],
                   dt_bias=weights.dt_bias[heads])  # fmt: skip


def by_key_head(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, shape: HeadShape):
    """[n, C], [n, Hv], [n, Hv] -> [n, Hk, 2 Dk + G Dv + 2 G]: each key head's q, k, its
    value heads' v, a and b side by side (what one all-to-all moves) (pure)."""
    n, key_width = mixed.shape[0], shape.key_heads * shape.key_dim
    q, k, v = mixed.split([key_width, key_width, mixed.shape[1] - 2 * key_width], dim=1)
    per_head = (q, k, v, a, b)
    return torch.cat([t.reshape(n, shape.key_heads, -1) for t in per_head], dim=2)


def from_key_heads(packed: torch.Tensor, shape: HeadShape):
    """Inverse of :func:`by_key_head` for any number of key heads: -> (mixed [N, C'] in
    [q; k; v] order, a [N, Hv'], b [N, Hv'])."""
    widths = [shape.key_dim, shape.key_dim, shape.group * shape.value_dim, shape.group,
              shape.group]  # fmt: skip
    q, k, v, a, b = (t.flatten(1) for t in packed.split(widths, dim=2))
    return torch.cat([q, k, v], dim=1), a, b


def ulysses_mix(
    mixer: nn.Module,
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    layout: TokenLayout,
    weights: HeadWeights,
) -> torch.Tensor:
    """This rank's tokens' in_proj_qkv, in_proj_a and in_proj_b outputs (``mixed`` [n, C],
    ``a``/``b`` [n, Hv]; a tensor-parallel rank's heads or all) and those heads' ``weights``
    -> the delta rule's output [n, Hv, Dv] for this rank's tokens. ``layout`` describes the
    whole stream (SP × n tokens)."""
    group = layout.sequence_group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = HeadShape.of(mixer, mixed.shape[1], a.shape[1])
    if shape.key_heads % size:
        raise ValueError(f"{shape.key_heads} Gated DeltaNet key heads cannot be split over "
                         f"{size} sequence-parallel ranks: the SP size must divide them")  # fmt: skip
    stream = tokens_to_heads(by_key_head(mixed, a, b, shape), group)  # [N, Hk/SP, ...]
    local = HeadShape(shape.key_heads // size, shape.group, shape.key_dim, shape.value_dim)
    mixed, a, b = from_key_heads(stream, local)
    core, _ = mixer.mix(mixed, a, b, layout, rank_weights(weights, shape, rank, size))
    return heads_to_tokens(core, group)  # [n, Hv, Dv]
