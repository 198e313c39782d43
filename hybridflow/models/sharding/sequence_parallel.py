"""Ulysses sequence parallelism for the packed forward (DeepSpeed-Ulysses, Jacobs et al. 2023,
arXiv:2309.14509).

Each rank of a sequence-parallel (SP) group holds a contiguous 1/SP slice of one packed token
stream (the stream padded to a multiple of SP). Everything but attention is per token, so it
runs on the slice as it is, RoPE included (each token keeps its own position id). Around
attention an all-to-all trades the token shard for a head shard: each rank then holds all
tokens for 1/SP of the heads and runs the ordinary packed attention over the whole stream
(same ``cu_seqlens``), and a second all-to-all trades back. Per layer and rank that moves
``4 × N/SP × (q + k + v + out heads) × head_dim`` values over the group; what a rank keeps
in memory scales as 1/SP.

KV heads are repeated before the exchange when SP does not divide their count (a 2-KV-head
model on SP = 4: each rank receives one copy of the KV head its query heads read).

The collectives are autograd functions over ``torch.distributed.all_to_all_single`` (NCCL and
gloo both have it), so the backward is the reverse exchange. Nothing here holds a process
group: every function receives the one it uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Where a rank's slice of a packed stream lies (pure)


@dataclass(frozen=True)
class StreamShard:
    """One rank's slice of a packed stream of ``num_tokens`` real tokens.

    The stream is padded with ``pad`` tokens to a multiple of the SP size (times the token
    multiple each slice needs); the padding forms a
    sequence of its own at the end of ``cu_seqlens`` (it attends only to itself and nothing
    attends to it), so the real tokens' outputs do not depend on it."""

    start: int
    """First token of this rank's slice in the padded stream."""
    stop: int
    """One past its last token; ``stop - start`` is the same on every rank."""
    pad: int
    """Padding tokens appended to the stream (they fall in the last ranks' slices)."""
    cu_seqlens: torch.Tensor
    """int32 [S+1] or [S+2]: the padded stream's sequence boundaries (the pad is one more)."""
    max_seqlen: int


def shard_stream(
    cu_seqlens: torch.Tensor, max_seqlen: int, rank: int, size: int, multiple: int = 1
) -> StreamShard:
    """The slice of rank ``rank`` out of ``size`` for the stream with boundaries ``cu_seqlens``;
    every rank's slice holds a multiple of ``multiple`` tokens (FP8 training's 16: the weight
    gradient's inner dim is a rank's token count)."""
    num_tokens = int(cu_seqlens[-1])
    per_rank = max(math.ceil(num_tokens / size), 1)
    per_rank = math.ceil(per_rank / multiple) * multiple
    pad = per_rank * size - num_tokens
    boundaries = cu_seqlens.to(torch.int32)
    if pad:
        boundaries = torch.cat([boundaries, boundaries.new_tensor([num_tokens + pad])])
    return StreamShard(
        start=rank * per_rank,
        stop=(rank + 1) * per_rank,
        pad=pad,
        cu_seqlens=boundaries,
        max_seqlen=max(int(max_seqlen), pad),
    )


def take_slice(values: torch.Tensor, shard: StreamShard, fill: int = 0) -> torch.Tensor:
    """``values [N, ...]`` of the unpadded stream -> this rank's ``[stop - start, ...]``, pad
    positions filled with ``fill``."""
    local = values[shard.start : shard.stop]
    missing = (shard.stop - shard.start) - local.shape[0]
    if missing:
        padding = values.new_full((missing, *values.shape[1:]), fill)
        local = torch.cat([local, padding])
    return local


def pad_positions(position_ids: torch.Tensor, shard: StreamShard) -> torch.Tensor:
    """Position ids [N] of this rank's slice, or mRoPE's rows [3, N] (a vision-language
    model's: each row sliced alike); the pad sequence counts 0, 1, ... like any other (text:
    three equal rows)."""
    local = position_ids[..., shard.start : shard.stop]
    missing = (shard.stop - shard.start) - local.shape[-1]
    if missing:
        num_tokens = position_ids.shape[-1]
        first = max(shard.start, num_tokens) - num_tokens  # pad tokens before this slice
        pad_positions = torch.arange(first, first + missing, device=position_ids.device)
        pad_positions = pad_positions.expand(*position_ids.shape[:-1], missing)
        local = torch.cat([local, pad_positions.to(position_ids.dtype)], dim=-1)
    return local


def output_range(hidden_index: torch.Tensor, shard: StreamShard) -> tuple[int, int]:
    """The outputs [a, b) whose predicting token lies in this slice; ``hidden_index`` [M] is
    ascending (packing.pack_rows), so they are one contiguous run."""
    a = int(torch.searchsorted(hidden_index, shard.start))
    b = int(torch.searchsorted(hidden_index, shard.stop))
    return a, b


def output_counts(hidden_index: torch.Tensor, shards: list[StreamShard]) -> list[int]:
    """How many outputs each rank's slice owns (every rank can compute every rank's)."""
    counts = []
    for shard in shards:
        a, b = output_range(hidden_index, shard)
        counts.append(b - a)
    return counts


# ---------------------------------------------------------------------------------------------
# Head arithmetic (pure)


def kv_repeats(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each KV head is repeated so that ``sp_size`` ranks each get whole KV
    heads for their ``num_heads / sp_size`` query heads (1 when SP divides the KV heads).
    ValueError when no repetition works (validate() refuses these layouts before a run)."""
    repeats = sp_size // math.gcd(num_kv_heads, sp_size)
    group = num_heads // num_kv_heads if num_kv_heads else 0
    if num_heads % sp_size or num_heads % num_kv_heads or group % repeats:
        raise ValueError(
            f"{num_heads} attention heads with {num_kv_heads} KV heads cannot be split over "
            f"{sp_size} sequence-parallel ranks: the heads must be a multiple of the SP size, "
            "and the SP size a multiple of the KV heads or a divisor of them"
        )
    return repeats


# ---------------------------------------------------------------------------------------------
# Collectives with a backward


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x [size, ...]``: block i goes to rank i; block j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after .contiguous(): empty_like keeps a transposed layout
    dist.all_to_all_single(out, x, group=group)
    return out


def _tokens_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    n_local, heads = x.shape[:2]
    blocks = x.reshape(n_local, size, heads // size, *x.shape[2:]).transpose(0, 1)
    return _all_to_all(blocks, group).reshape(size * n_local, heads // size, *x.shape[2:])


def _heads_to_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    n, heads = x.shape[:2]
    received = _all_to_all(x.reshape(size, n // size, heads, *x.shape[2:]), group)
    return received.transpose(0, 1).reshape(n // size, size * heads, *x.shape[2:])


class _TokensToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _tokens_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_tokens(grad, ctx.group), None


class _HeadsToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _tokens_to_heads(grad, ctx.group), None


def tokens_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x [N/SP, heads, ...]`` (this rank's tokens, all heads) -> ``[N, heads/SP, ...]`` (all
    tokens in rank order, this rank's heads). Differentiable."""
    return _TokensToHeads.apply(x, group)


def heads_to_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of :func:`tokens_to_heads`: ``[N, heads/SP, ...]`` -> ``[N/SP, heads, ...]``."""
    return _HeadsToTokens.apply(x, group)


def ulysses_attention(attend: Attend, group: dist.ProcessGroup) -> Attend:
    """Wrap a packed attention over the whole stream (built with the padded stream's
    ``cu_seqlens``) into one that takes and returns this rank's tokens:
    q [N/SP, nh, hd], k/v [N/SP, nkv, hd] -> [N/SP, nh, hd]."""
    size = dist.get_world_size(group)

    def attend_sharded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        repeats = kv_repeats(q.shape[1], k.shape[1], size)
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        q, k, v = (tokens_to_heads(t, group) for t in (q, k, v))
        return heads_to_tokens(attend(q, k, v), group)

    return attend_sharded


class _GatherOutputs(torch.autograd.Function):
    """All-gather of per-rank runs of different lengths, concatenated in rank order. Every rank
    then computes the same loss from the whole; the backward hands each rank the gradient of
    its own run (not a sum: the loss is replicated, not split)."""

    @staticmethod
    def forward(ctx, local, counts, group):
        rank = dist.get_rank(group)
        ctx.span = (sum(counts[:rank]), counts[rank])
        longest = max(max(counts), 1)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: local.shape[0]] = local
        blocks = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(blocks, padded, group=group)
        return torch.cat([block[:count] for block, count in zip(blocks, counts)])

    @staticmethod
    def backward(ctx, grad):
        offset, count = ctx.span
        return grad[offset : offset + count], None, None


def gather_outputs(
    local: torch.Tensor, counts: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """``local [counts[rank], ...]`` on each rank -> ``[sum(counts), ...]`` on every rank, in
    rank order. Differentiable (see :class:`_GatherOutputs`)."""
    if local.shape[0] != counts[dist.get_rank(group)]:
        raise ValueError(f"{local.shape[0]} local outputs but counts say {counts}")
    return _GatherOutputs.apply(local, list(counts), group)
