"""DeepSeek-V3's grouped sigmoid routing (models/mlps/grouped_experts.py, topk_method
"noaux_tc") after the router's fp32 linear map, in one launch: sigmoid scores, the score
correction, the topk_group best groups (a group scores the sum of its two best), the top-k of
their experts, the weights (the scores at the winners, renormalised when asked, scaled) and
the ids written to the routing record. The model's torch ops take ~9 launches for the same
(the engine's decode step runs one a sparse layer). Ties go to the lower expert (group) id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.kernels.experts.routing import (
    RouteRecord,
    _router_rows,
    _store_routes,
    record_arguments,
    route_block,
    route_buffers,
)


@triton.jit
def _grouped_route_kernel(
    logits_ptr, correction_ptr, ids_ptr, weights_ptr, routes_ptr, entry_ptr, offset_ptr, T, E,
    stride_l, stride_re, stride_ro, route_col, scaling,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, RENORM: tl.constexpr, RECORD: tl.constexpr,
):  # fmt: skip
    rows64, row_mask, cols, col_mask = _router_rows(T, E, BLOCK_T, E_PAD)
    x = tl.load(logits_ptr + rows64[:, None] * stride_l + cols[None, :],
                mask=col_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
    scores = 1.0 / (1.0 + tl.exp(-x))
    correction = tl.load(correction_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    choice = tl.where(col_mask[None, :], scores + correction[None, :], float("-inf"))
    if N_GROUP > 1:
        group = cols // GROUP_SIZE
        slots = tl.arange(0, G_PAD)
        group_scores = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_group = tl.where((group == g)[None, :], choice, float("-inf"))
            best = tl.max(in_group, axis=1)
            score = best
            if GROUP_SIZE > 1:  # plus its second best
                first = tl.min(tl.where(in_group == best[:, None], cols[None, :], E_PAD), axis=1)
                rest = tl.where(cols[None, :] == first[:, None], float("-inf"), in_group)
                score = best + tl.max(rest, axis=1)
            group_scores = tl.where(slots[None, :] == g, score[:, None], group_scores)
        kept = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_scores, axis=1)
            chosen = tl.min(tl.where(group_scores == best[:, None], slots[None, :], G_PAD), axis=1)
            kept = kept | (group[None, :] == chosen[:, None])
            group_scores = tl.where(slots[None, :] == chosen[:, None], float("-inf"), group_scores)
        choice = tl.where(kept, choice, float("-inf"))
    slots_k = tl.arange(0, K_PAD)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    values = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        index = tl.min(tl.where(choice == best[:, None], cols[None, :], E_PAD), axis=1)
        picked = cols[None, :] == index[:, None]
        weight = tl.sum(tl.where(picked, scores, 0.0), axis=1)
        ids = tl.where(slots_k[None, :] == j, index[:, None], ids)
        values = tl.where(slots_k[None, :] == j, weight[:, None], values)
        choice = tl.where(picked, float("-inf"), choice)
    if RENORM:
        values = values / (tl.sum(values, axis=1)[:, None] + 1e-20)
    values = values * scaling
    _store_routes(ids, values, rows64, row_mask, ids_ptr, weights_ptr, routes_ptr, entry_ptr,
                  offset_ptr, stride_re, stride_ro, route_col, TOP_K, K_PAD, RECORD)  # fmt: skip


def grouped_route(logits: torch.Tensor, correction: torch.Tensor, top_k: int, n_group: int,
                  topk_group: int, renormalize: bool, scaling: float,
                  record: RouteRecord | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [T, E] fp32 (the router's linear map), correction [E] -> (ids [T, k] int32,
    weights [T, k] fp32): grouped_experts.grouped_topk's winners and grouped_weights'
    weights; record: the ids also to the routing record."""
    tokens, experts = logits.shape
    assert logits.stride(1) == 1 and experts % n_group == 0
    ids, weights = route_buffers(logits, top_k)
    if tokens == 0:
        return ids, weights
    routes, entries, offsets, strides, column = record_arguments(record, ids)
    block = route_block(experts)
    _grouped_route_kernel[(triton.cdiv(tokens, block),)](
        logits, correction, ids, weights, routes, entries, offsets, tokens, experts,
        logits.stride(0), *strides, column, float(scaling), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(experts),
        N_GROUP=n_group, G_PAD=max(triton.next_power_of_2(n_group), 2), TOPK_GROUP=topk_group,
        GROUP_SIZE=experts // n_group, BLOCK_T=block, RENORM=renormalize,
        RECORD=record is not None, num_warps=4,
    )  # fmt: skip
    return ids, weights
