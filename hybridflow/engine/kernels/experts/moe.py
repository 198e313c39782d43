"""Triton kernels of a mixture-of-experts layer: routing, the token -> expert sort, grouped
expert matmuls that read only the experts a batch touches, and the weighted combine.

One sparse layer, T tokens, E experts, top-k each (P = T * k (token, expert) pairs):

1. `routing.route_topk`: softmax over the router logits in fp32, top-k (descending, as torch.topk),
   renormalised when the model says so; optionally each token's expert ids are written to the
   engine's routing record (routing replay: kv_cache.KVCache.routes).
2. `align_pairs`: the pairs sorted by expert (stable: in pair order inside an expert), each
   expert's run padded to a multiple of BLOCK_M, with the expert of every BLOCK_M block. Two
   launches of one program per expert (its count, then its placement); deterministic, no
   atomics, no host sync (CUDA graphs).
3. `grouped_gate_up`: per block, its expert's gate and up rows times the block's tokens,
   silu(gate) * up in the epilogue (the [P, 2I] product is never written); `grouped_down`:
   the down projection, each pair's row written back at its pair index. Each expert's weights
   are read by its own blocks only: at decode sizes the layer costs the bytes of the experts
   the batch touches (H200, 256 rows of Qwen3-30B-A3B: all 128 of them).
4. `combine`: each token's k rows weighted by its routing weights, summed in fp32 in top-k
   order (deterministic), rounded once.

The weights are the model's packed expert tensors, read in place (Hugging Face layout):
gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]; or, for the fp8 rollout, e4m3
copies of them with an fp32 scale per row (engine/fp8/experts.py), widened to the
activations' dtype tile by tile in the inner loop and scaled in the epilogue (weight-only:
half the bytes a decode step reads).

Rounding follows the eager reference (models/moe.py): each projection rounded to the
activation dtype, silu rounded, then the product; the combine is fp32 (the reference adds the
k contributions in the activation dtype, one rounding each: within a rounding step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# -------------------------------------------------------------------------------------------
# 2. Pairs sorted by expert, runs padded to BLOCK_M


@triton.jit
def _local_ids(ids_ptr, offs, P, E, first):
    """Pair ids as local experts [0, E) (global id - first); pairs past P and pairs routed to
    experts this rank does not hold -> E (no expert's: never counted nor placed)."""
    local = tl.load(ids_ptr + offs, mask=offs < P, other=-1) - first
    return tl.where((offs < P) & (local >= 0) & (local < E), local, E)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, P, E, first, CHUNK: tl.constexpr):
    """Program e: counts[e] = the pairs routed to local expert e (_local_ids). One compare and
    one sum a chunk: each program counts its own expert, so no program builds the whole
    histogram (the placement reads the counts back)."""
    e = tl.program_id(0)
    count = tl.full([], 0, dtype=tl.int32)
    for start in range(0, P, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = _local_ids(ids_ptr, offs, P, E, first)
        count += tl.sum((ids == e).to(tl.int32), axis=0)
    tl.store(counts_ptr + e, count)


@triton.jit
def _align_kernel(
    ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, total_ptr, ends_ptr, P, E, first,
    BINS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program e: reads every expert's count (_count_kernel), places expert e's run at the sum
    of the padded runs before it, writes its pairs' indices there in pair order (then P, the
    padding marker, up to the padded length) and e as the expert of each of its blocks, and
    the end of its run to ends[e]. Program 0 writes the padded total."""
    e = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    # the first chunk of pair ids is read before the counts, so that the two reads' latencies
    # overlap (at decode sizes the pairs are one chunk); each pass of the loop reads the next
    ids = _local_ids(ids_ptr, lanes, P, E, first)
    bins = tl.arange(0, BINS)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    count_e = tl.load(counts_ptr + e)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start_e = tl.sum(tl.where(bins < e, padded, 0), axis=0)
    padded_e = (count_e + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(ends_ptr + e, start_e + padded_e)
    if e == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))
    if count_e > 0:  # an expert without pairs has nothing to place
        placed = tl.full([], 0, dtype=tl.int32)
        for start in range(0, P, CHUNK):
            hit = (ids == e).to(tl.int32)
            rank = placed + tl.cumsum(hit, axis=0) - 1
            tl.store(sorted_ptr + start_e + rank, start + lanes, mask=hit > 0)
            placed += tl.sum(hit, axis=0)
            ids = _local_ids(ids_ptr, start + CHUNK + lanes, P, E, first)  # none past P
        pad = count_e + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + start_e + pad, P, mask=pad < padded_e)
        first_block = start_e // BLOCK_M
        for block in range(0, padded_e // BLOCK_M, CHUNK):
            index = block + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + first_block + index, e,
                     mask=index < padded_e // BLOCK_M)  # fmt: skip


@dataclass
class ExpertBlocks:
    """The pairs of a layer sorted by expert (align_pairs). sorted_pairs [capacity] int32:
    pair indices (token * k + slot), P marking padding; block_expert [capacity / block_m]
    int32: each block's expert; total [1] int32: the padded length in use (blocks past it
    hold nothing); group_ends [E] int32: where each expert's run ends (torch._grouped_mm's
    offsets). capacity is the static bound P + E * (block_m - 1), rounded up. subset: the
    experts are a share of the model's (align_pairs' first_expert): pairs routed elsewhere
    are in no block, and their output rows are zeros."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    total: torch.Tensor
    group_ends: torch.Tensor
    block_m: int
    pairs: int
    top_k: int
    subset: bool = False

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int,
                first_expert: int | None = None) -> ExpertBlocks:  # fmt: skip
    """ids [T, k] int32 -> ExpertBlocks (static shapes: under CUDA graphs the grid is the
    bound, and blocks past `total` return at once). first_expert: the weights hold the
    model's experts [first_expert, first_expert + num_experts) only (a rank's share in the
    tensor-parallel rollout, engine/tensor_parallel.py): blocks name local experts and the
    pairs routed to other experts are skipped; None: ids are the weights' own."""
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    max_blocks = triton.cdiv(pairs, block_m) + num_experts
    device = ids.device
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    # Two launches: each expert's count, then its placement. One kernel where every program
    # built the full histogram of expert ids (tl.histogram) cost 24 us a layer at 256 rows
    # (H200); a count is one compare and one sum a chunk. Each program walks all the pairs
    # (the counts once, the placement once more): few wide chunks, not many dependent ones.
    chunk = min(max(triton.next_power_of_2(pairs), 256), 4096)
    warps = 8 if chunk >= 2048 else 4
    first = first_expert or 0
    _count_kernel[(num_experts,)](ids, counts, pairs, num_experts, first, CHUNK=chunk,
                                  num_warps=warps)  # fmt: skip
    _align_kernel[(num_experts,)](
        ids, counts, sorted_pairs, block_expert, total, ends, pairs, num_experts, first,
        BINS=max(triton.next_power_of_2(num_experts), 2), BLOCK_M=block_m, CHUNK=chunk,
        num_warps=warps,
    )  # fmt: skip
    return ExpertBlocks(sorted_pairs, block_expert, total, ends, block_m, pairs, top_k,
                        subset=first_expert is not None)  # fmt: skip


# -------------------------------------------------------------------------------------------
# 3. Grouped expert matmuls


@triton.jit
def _grouped_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ptr, block_expert_ptr, total_ptr, P, N, K, stride_am,
    stride_we, stride_wn, stride_cm, up_rows,
    TOP_K: tl.constexpr, GATHER: tl.constexpr, SILU_UP: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    scale_ptr=None, stride_se=0, W_FP8: tl.constexpr = False,
):  # fmt: skip
    """One BLOCK_M block of sorted pairs (one expert) x BLOCK_N output columns.

    GATHER (gate/up): a row of pair p is token p // TOP_K of a [T, K]; the output rows follow
    the sorted order (c [capacity, N]). Else (down) a's rows are in sorted order already and
    each valid row goes to c[pair] ([P, N]).
    SILU_UP: w's rows [n, n + BLOCK_N) are gate columns, [up_rows + n, ...) the matching up
    columns; c gets silu(gate) * up, rounded as torch rounds F.silu(gate) * up.
    W_FP8 (the fp8 rollout's experts, weight-only): w holds float8 e4m3 with a scale per
    output row, scale [E, rows] (stride_se a expert); each tile is widened to a's dtype in
    the loop (exact: every e4m3 value is a bf16 one) and the fp32 sums are multiplied by
    their rows' scales before the epilogue rounds them."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert, positions, pairs, valid, a_rows = _block_pairs(sorted_ptr, block_expert_ptr, pid_m,
                                                           P, TOP_K, GATHER, BLOCK_M)  # fmt: skip
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn_safe = tl.where(n_mask, rn, 0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + expert * stride_we + rn_safe[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        if W_FP8:
            w = w.to(a.dtype)
        if FP32:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        if SILU_UP:
            u = tl.load(w_ptrs + up_rows * stride_wn, mask=k_mask[None, :], other=0.0)
            if W_FP8:
                u = u.to(a.dtype)
            if FP32:
                acc_up = tl.dot(a, tl.trans(u), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, tl.trans(u), acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_FP8:  # each output row's scale (a row of w: a column of the product)
        scales = scale_ptr + expert * stride_se + rn_safe
        acc = acc * tl.load(scales)[None, :]
        if SILU_UP:
            acc_up = acc_up * tl.load(scales + up_rows)[None, :]
    dtype = c_ptr.dtype.element_ty
    if SILU_UP:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        c = c_ptr + positions.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c, (silu * up).to(dtype), mask=n_mask[None, :])
    else:
        _store_pair_rows(c_ptr, acc, pairs, valid, rn, n_mask, stride_cm)


@triton.jit
def _block_pairs(sorted_ptr, block_expert_ptr, pid_m, P, TOP_K: tl.constexpr,
                 GATHER: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Block pid_m of the sorted pairs (one expert): (its expert, its positions in the sorted
    order, their pairs, which are pairs and not padding, the rows of a they read). GATHER
    (gate/up): pair p reads token p // TOP_K of a [T, K], padding row 0; else a's rows are
    in sorted order already."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    positions = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + positions)
    valid = pairs < P
    if GATHER:
        a_rows = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)  # padding reads row 0
    else:
        a_rows = positions.to(tl.int64)
    return expert, positions, pairs, valid, a_rows


@triton.jit
def _store_pair_rows(c_ptr, acc, pairs, valid, rn, n_mask, stride_cm):
    """The down projection's block: each pair's row to c[pair] ([P, N]) in c's dtype, the
    padding rows not written."""
    out_rows = tl.where(valid, pairs, 0).to(tl.int64)
    c = c_ptr + out_rows[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


# (block_n, block_k, warps, stages) of each kernel by the rows a block holds, the fastest of
# benchmarks/moe_layer.py --sweep on an H200 at the Qwen3-30B-A3B shape: decode blocks are
# weight-bound (each touched expert's tiles streamed once), prefill blocks compute-bound.
TILES = {
    16: {"gate_up": (64, 128, 4, 4), "down": (64, 128, 4, 4)},
    32: {"gate_up": (128, 128, 8, 3), "down": (128, 128, 4, 3)},  # 256 rows: 0.204 + 0.118 ms
    64: {"gate_up": (128, 64, 4, 4), "down": (128, 128, 4, 3)},  # 1024 rows: 0.278 + 0.185 ms
    128: {"gate_up": (128, 64, 8, 3), "down": (128, 64, 8, 3)},
}
FP32_TILE = (32, 64, 4, 2)  # twice the bytes a tile: the bf16 tiles overflow shared memory


def _tile(block_m: int, kernel: str, x: torch.Tensor) -> tuple[int, int, int, int]:
    if x.device.type != "cuda":  # the interpreter: its cost is per program and per op
        return 128, 128, 1, 1
    return FP32_TILE if x.dtype == torch.float32 else TILES[block_m][kernel]


def grouped_launch(blocks: ExpertBlocks, columns: int, kernel: str, x: torch.Tensor,
                   tile: tuple | None = None) -> tuple[tuple[int, int], dict]:  # fmt: skip
    """A grouped kernel's grid (a program a block and BLOCK_N of the ``columns`` outputs)
    and its tile's launch keywords: ``tile`` (block_n, block_k, warps, stages), else
    TILES' for ``kernel`` ("gate_up" or "down") at the blocks' rows and x's dtype."""
    block_n, block_k, warps, stages = tile or _tile(blocks.block_m, kernel, x)
    grid = (blocks.max_blocks, triton.cdiv(columns, block_n))
    return grid, dict(BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                      num_warps=warps, num_stages=stages)  # fmt: skip


def _fp8_weights(weight: torch.Tensor, scale: torch.Tensor | None) -> dict:
    """The grouped kernel's keywords for weights in the activations' dtype (scale None), or
    float8 e4m3 ones with a scale per output row (scale [E, rows] fp32, rows contiguous)."""
    if scale is None:
        return {}
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == weight.shape[:2] and scale.stride(1) == 1
    return dict(scale_ptr=scale, stride_se=scale.stride(0), W_FP8=True)


def grouped_gate_up(x: torch.Tensor, gate_up: torch.Tensor, blocks: ExpertBlocks,
                    tile: tuple | None = None,
                    scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, H], gate_up [E, 2I, H] -> silu(gate) * up [capacity, I], rows in sorted order.
    tile: (block_n, block_k, warps, stages) instead of TILES' (benchmarks/moe_layer.py).
    scale [E, 2I] fp32: gate_up is float8 e4m3, row r of expert e times scale[e, r]."""
    inner = gate_up.shape[1] // 2
    out = torch.empty(blocks.sorted_pairs.shape[0], inner, dtype=x.dtype, device=x.device)
    grid, launch = grouped_launch(blocks, inner, "gate_up", x, tile)
    _grouped_kernel[grid](
        x, gate_up, out, blocks.sorted_pairs, blocks.block_expert, blocks.total, blocks.pairs,
        inner, x.shape[1], x.stride(0), gate_up.stride(0), gate_up.stride(1), out.stride(0),
        inner, TOP_K=blocks.top_k, GATHER=True, SILU_UP=True, FP32=x.dtype == torch.float32,
        **launch, **_fp8_weights(gate_up, scale),
    )  # fmt: skip
    return out


def grouped_down(act: torch.Tensor, down: torch.Tensor, blocks: ExpertBlocks,
                 tile: tuple | None = None,
                 scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """act [capacity, I] (sorted order), down [E, H, I] -> [P, H], row p = pair p's output
    (zeros for a pair no block holds: routed to an expert of another rank). scale [E, H]
    fp32: down is float8 e4m3, as grouped_gate_up's."""
    hidden = down.shape[1]
    allocate = torch.zeros if blocks.subset else torch.empty  # empty: every row is written
    out = allocate(blocks.pairs, hidden, dtype=act.dtype, device=act.device)
    grid, launch = grouped_launch(blocks, hidden, "down", act, tile)
    _grouped_kernel[grid](
        act, down, out, blocks.sorted_pairs, blocks.block_expert, blocks.total, blocks.pairs,
        hidden, act.shape[1], act.stride(0), down.stride(0), down.stride(1), out.stride(0), 0,
        TOP_K=blocks.top_k, GATHER=False, SILU_UP=False, FP32=act.dtype == torch.float32,
        **launch, **_fp8_weights(down, scale),
    )  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------
# 4. Weighted combine


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, stride_y, stride_o, TOP_K: tl.constexpr,
                    BLOCK_H: tl.constexpr, bias_ptr=None, ids_ptr=None, stride_b=0,
                    HAS_BIAS: tl.constexpr = False):  # fmt: skip
    """out[t] = sum_j weights[t, j] * y[t * TOP_K + j] in fp32, j in order, rounded once.
    HAS_BIAS: each row first gets its expert's bias[ids[t, j]], the sum rounded to y's dtype
    (as the model adds a bias)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        weight = tl.load(w_ptr + token * TOP_K + j)
        y = tl.load(y_ptr + (token * TOP_K + j) * stride_y + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            expert = tl.load(ids_ptr + token * TOP_K + j).to(tl.int64)
            bias = tl.load(bias_ptr + expert * stride_b + cols, mask=mask, other=0.0)
            y = (y.to(tl.float32) + bias.to(tl.float32)).to(y.dtype)
        acc += y.to(tl.float32) * weight
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(y: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor | None = None,
            ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """y [T * k, H] (pair rows), weights [T, k] fp32 -> [T, H] in y's dtype. bias [E, H]
    with ids [T, k] (contiguous): each pair's expert's bias added to its row first."""
    tokens, top_k = weights.shape
    out = torch.empty(tokens, y.shape[1], dtype=y.dtype, device=y.device)
    extra = {}
    if bias is not None:
        assert bias.stride(1) == 1 and ids.is_contiguous() and ids.shape == weights.shape
        extra = dict(bias_ptr=bias, ids_ptr=ids, stride_b=bias.stride(0), HAS_BIAS=True)
    if tokens:
        _combine_kernel[(tokens,)](y, weights, out, y.shape[1], y.stride(0), out.stride(0),
                                   TOP_K=top_k, BLOCK_H=triton.next_power_of_2(y.shape[1]),
                                   num_warps=4, **extra)  # fmt: skip
    return out


def block_rows(tokens: int, top_k: int, num_experts: int) -> int:
    """BLOCK_M for T tokens by the mean pairs per expert: most experts fit one or two blocks
    (read their weights once or twice), from 16 (tl.dot's least) to 128. The bounds are the
    sweep's (H200, 30B-A3B): 256 rows (16 a expert) fastest at 32, 1024 (64) at 64."""
    mean = tokens * top_k / num_experts
    for size, most in ((16, 8), (32, 24), (64, 96)):
        if mean <= most:
            return size
    return 128
