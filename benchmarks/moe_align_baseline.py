"""The former sort by expert of engine/kernels/experts/moe.py, one launch: every program builds the
full histogram of the pairs' expert ids (tl.histogram), then places its own expert's pairs.
benchmarks/moe_layer.py --align times it beside align_pairs (its count and placement
launches) on the same routing, as the baseline of that change."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.kernels.experts.moe import ExpertBlocks, _local_ids


@triton.jit
def _histogram_align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, ends_ptr, P, E, first,
    BINS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, P, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        counts += tl.histogram(_local_ids(ids_ptr, offs, P, E, first), BINS)
    counts = tl.where(bins < E, counts, 0)  # bin E: pairs of no local expert
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start_e = tl.sum(tl.where(bins < e, padded, 0), axis=0)
    count_e = tl.sum(tl.where(bins == e, counts, 0), axis=0)
    padded_e = tl.sum(tl.where(bins == e, padded, 0), axis=0)
    tl.store(ends_ptr + e, start_e + padded_e)
    if e == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))
    placed = tl.full([], 0, dtype=tl.int32)
    for start in range(0, P, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        hit = (_local_ids(ids_ptr, offs, P, E, first) == e).to(tl.int32)
        rank = placed + tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_ptr + start_e + rank, offs, mask=hit > 0)
        placed += tl.sum(hit, axis=0)
    pad = count_e + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start_e + pad, P, mask=pad < padded_e)
    first_block = start_e // BLOCK_M
    for block in range(0, padded_e // BLOCK_M, CHUNK):
        index = block + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + first_block + index, e, mask=index < padded_e // BLOCK_M)


def histogram_align(ids: torch.Tensor, num_experts: int, block_m: int,
                    first_expert: int | None = None) -> ExpertBlocks:  # fmt: skip
    """align_pairs' contract, one launch (the baseline)."""
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    max_blocks = triton.cdiv(pairs, block_m) + num_experts
    device = ids.device
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    chunk = min(max(triton.next_power_of_2(pairs), 256), 4096)
    _histogram_align_kernel[(num_experts,)](
        ids, sorted_pairs, block_expert, total, ends, pairs, num_experts, first_expert or 0,
        BINS=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m, CHUNK=chunk,
        num_warps=8 if chunk >= 2048 else 4,
    )  # fmt: skip
    return ExpertBlocks(sorted_pairs, block_expert, total, ends, block_m, pairs, top_k,
                        subset=first_expert is not None)  # fmt: skip
