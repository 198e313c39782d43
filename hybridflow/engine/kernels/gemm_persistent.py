"""A persistent x @ W^T for the large gate/up matmuls (prefill passes, 1024-row decode steps).

Why: gemm.gemm_nt runs one program per output tile. At K = 896 (qwen2.5-0.5b) a tile is only
14 K-steps, so every program pays a pipeline fill (the first `stages` loads with nothing to
multiply) and an epilogue (SiLU, stores) during which its SM's tensor cores idle. In the
1024-prompt prefill our SiLU gate/up ran at ~580 TFLOP/s (94 of the 186 ms of the
prefill) where cuBLAS's lm_head, the same K, reached ~720. Here `programs` programs (a
multiple of the SM count) each walk a strided list of tiles; the loop over tiles and the loop
over K are flattened into one (tl.range(flatten=True)), so the software pipeliner issues the
next tile's first loads before this tile's epilogue and the fill is paid once per program,
not once per tile.

The arithmetic is gemm_nt's: TMA tiles, fp32 accumulation in K order, the same epilogue
(gemm._gemm_epilogue: bias, SiLU pairs rounded like the torch ops), so for one tile shape
the two kernels give bitwise the same output. DecodeMatmul (matmul_choice.py) times both and
keeps the faster per shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.kernels.gemm import _gemm_epilogue, tma_operands


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile number -> (row tile, column tile), GROUP_M row tiles walking the columns together:
    the programs running at one time read few weight tiles and few row blocks, so both stay
    in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    size = tl.minimum(tiles_m - first_m, GROUP_M)
    within = tile % per_group
    return first_m + within % size, within // size


@triton.jit
def _persistent_nt_kernel(
    a_desc, w_desc, bias_ptr, c_ptr, M, N, K, stride_cm, PROGRAMS,
    HAS_BIAS: tl.constexpr, SILU_PAIRS: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Program p computes tiles p, p + PROGRAMS, p + 2 PROGRAMS, ... (numbered by
    _tile_coords). a_desc [M, K] / w_desc [N, K] tensor descriptors (rows and columns past
    the end read as zeros, so K needs no multiple of BLOCK_K)."""
    start = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_iters = tl.cdiv(K, BLOCK_K)
    # The epilogue keeps its own tile counter: after flattening, the loads of tile t + 1 are
    # issued before tile t's epilogue runs, so the loop's index has already moved on.
    stored = start - PROGRAMS
    dtype = c_ptr.dtype.element_ty
    for tile in tl.range(start, tiles_m * tiles_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_iters):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            if FP32:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        stored += PROGRAMS
        pid_m, pid_n = _tile_coords(stored, tiles_m, tiles_n, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = rm < M
        n_mask = rn < N
        rn_safe = tl.where(n_mask, rn, 0).to(tl.int64)
        _gemm_epilogue(
            acc, bias_ptr, c_ptr, c_ptr, stride_cm, 0, pid_n, rm.to(tl.int64), rn, rn_safe,
            m_mask, n_mask, N, dtype, HAS_BIAS, SILU_PAIRS, False, BLOCK_M, BLOCK_N,
        )  # fmt: skip


def gemm_persistent(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple,
    programs: int,
    silu_pairs: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """gemm.gemm_nt's contract without split-K: x [M, K] @ weight [N, K]^T (+ bias); with
    silu_pairs, weight rows interleaved gate/up and the result silu(gate) * up [M, N / 2].

    config: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M); programs: how many
    programs loop over the tiles (at most one per tile). Needs operands TMA can read (16-byte
    aligned base and row stride; gemm.tma_ready) on an sm_90+ GPU or the interpreter."""
    a_desc, w_desc, out, launched = _operands("gemm_persistent", x, weight, config, programs,
                                              silu_pairs, out)  # fmt: skip
    block_m, block_n, block_k, warps, stages, group_m = config
    _persistent_nt_kernel[(launched,)](
        a_desc, w_desc, bias if bias is not None else weight, out, x.shape[0], weight.shape[0],
        x.shape[1], out.stride(0), launched, HAS_BIAS=bias is not None, SILU_PAIRS=silu_pairs,
        FP32=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _operands(name, x, weight, config, programs, silu_pairs, out):
    """Checks of gemm_persistent's operands -> (x's and weight's TMA descriptors, the
    output (allocated unless given), programs to launch: at most one per output tile)."""
    rows, depth = x.shape
    cols = weight.shape[0]
    block_m, block_n, block_k = config[:3]
    if weight.shape[1] != depth or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"{name} needs x [M, K] and weight [N, K] with contiguous rows")
    if silu_pairs and cols % 2:
        raise ValueError(f"silu_pairs needs an even number of weight rows, got {cols}")
    a_desc, w_desc, tma = tma_operands(x, weight, block_m, block_n, block_k, tma=True)
    if not tma:
        raise ValueError(f"{name} needs TMA-readable operands (16-byte aligned rows)")
    if out is None:
        out = torch.empty(rows, cols // 2 if silu_pairs else cols, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n)
    return a_desc, w_desc, out, max(1, min(programs, tiles))
