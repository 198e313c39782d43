"""The routing kernel of a mixture-of-experts layer (kernels/experts/moe.py's step 1): softmax over
the router logits in fp32, top-k (descending, as torch.topk), renormalised when the model
says so; optionally each token's expert ids are written to the engine's routing record
(routing replay: kv_cache.KVCache.routes). grouped_route.py routes DeepSeek-V3's way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_kernel(
    logits_ptr, ids_ptr, weights_ptr, routes_ptr, entry_ptr, offset_ptr, T, E, stride_l,
    stride_re, stride_ro, route_col,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    RENORM: tl.constexpr, RECORD: tl.constexpr,
):  # fmt: skip
    """BLOCK_T rows a program: softmax (fp32) of logits [T, E], the TOP_K largest (ties: the
    lower expert id) -> ids [T, TOP_K] int32, weights [T, TOP_K] fp32 (divided by their sum
    when RENORM). RECORD: ids also to routes[entry[t], offset[t], route_col + j] (the
    routing record of the token's cache position)."""
    rows64, row_mask, cols, col_mask = _router_rows(T, E, BLOCK_T, E_PAD)
    x = tl.load(logits_ptr + rows64[:, None] * stride_l + cols[None, :],
                mask=col_mask[None, :], other=float("-inf")).to(tl.float32)  # fmt: skip
    shifted = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = shifted / tl.sum(shifted, axis=1)[:, None]  # padded columns: exp(-inf) = 0
    work = tl.where(col_mask[None, :], probs, -1.0)
    slots = tl.arange(0, K_PAD)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    values = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(work, axis=1)
        index = tl.min(tl.where(work == best[:, None], cols[None, :], E_PAD), axis=1)
        ids = tl.where(slots[None, :] == j, index[:, None], ids)
        values = tl.where(slots[None, :] == j, best[:, None], values)
        work = tl.where(cols[None, :] == index[:, None], -2.0, work)
    if RENORM:
        values = values / tl.sum(values, axis=1)[:, None]
    _store_routes(ids, values, rows64, row_mask, ids_ptr, weights_ptr, routes_ptr, entry_ptr,
                  offset_ptr, stride_re, stride_ro, route_col, TOP_K, K_PAD, RECORD)  # fmt: skip


@triton.jit
def _router_rows(T, E, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr):
    """A routing program's BLOCK_T token rows (int64, padding rows at 0) and E_PAD expert
    columns, with their masks: (rows64, row_mask, cols, col_mask)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_mask = rows < T
    col_mask = cols < E
    rows64 = tl.where(row_mask, rows, 0).to(tl.int64)
    return rows64, row_mask, cols, col_mask


@triton.jit
def _store_routes(ids, values, rows64, row_mask, ids_ptr, weights_ptr, routes_ptr, entry_ptr,
                  offset_ptr, stride_re, stride_ro, route_col, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, RECORD: tl.constexpr):  # fmt: skip
    """A routing program's winners, ids [BLOCK_T, K_PAD] and their weights, to ids [T, TOP_K]
    and weights [T, TOP_K]; RECORD: the ids also to routes[entry[t], offset[t], route_col +
    j] (the routing record of the token's cache position)."""
    slots = tl.arange(0, K_PAD)
    out = rows64[:, None] * TOP_K + slots[None, :]
    mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(ids_ptr + out, ids, mask=mask)
    tl.store(weights_ptr + out, values, mask=mask)
    if RECORD:
        entry = tl.load(entry_ptr + rows64, mask=row_mask, other=0)
        offset = tl.load(offset_ptr + rows64, mask=row_mask, other=0)
        where = entry * stride_re + offset * stride_ro + route_col
        record = routes_ptr + where[:, None] + slots[None, :]
        tl.store(record, ids.to(routes_ptr.dtype.element_ty), mask=mask)


@dataclass
class RouteRecord:
    """Where route_topk writes a layer's expert ids: routes[entries[t], offsets[t], column:
    column + k] (kv_cache.KVCache.routes; entries/offsets [T] int64, the tokens' cache
    locations)."""

    routes: torch.Tensor
    entries: torch.Tensor
    offsets: torch.Tensor
    column: int


def route_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, record: RouteRecord | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (the router's output, any float dtype) -> (ids [T, k] int32, weights
    [T, k] fp32): softmax in fp32, top-k descending, renormalised when asked."""
    tokens, experts = logits.shape
    ids, weights = route_buffers(logits, top_k)
    if tokens == 0:
        return ids, weights
    block = route_block(experts)
    routes, entries, offsets, strides, column = record_arguments(record, ids)
    _topk_kernel[(triton.cdiv(tokens, block),)](
        logits, ids, weights, routes, entries, offsets, tokens, experts, logits.stride(0),
        *strides, column, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(experts), BLOCK_T=block, RENORM=renormalize,
        RECORD=record is not None, num_warps=4,
    )  # fmt: skip
    return ids, weights


def route_buffers(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing kernel's outputs for logits [T, E]: (ids [T, k] int32, weights [T, k] fp32)."""
    tokens = logits.shape[0]
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    return ids, weights


def route_block(experts: int) -> int:
    """A routing program's token rows (BLOCK_T): [BLOCK_T, E_PAD] fp32 in registers."""
    return 16 if experts <= 256 else 4


def record_arguments(record: RouteRecord | None, ids: torch.Tensor) -> tuple:
    """A routing kernel's record arguments: (routes, entries, offsets, (stride of an entry,
    stride of a position), column); without a record (RECORD off, nothing read) ``ids``
    stands in for the pointers."""
    if record is None:
        return ids, ids, ids, (0, 0), 0
    routes = record.routes
    return (routes, record.entries, record.offsets, (routes.stride(0), routes.stride(1)),
            record.column)  # fmt: skip
