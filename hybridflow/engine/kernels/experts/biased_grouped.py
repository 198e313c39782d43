"""GPT-OSS's expert matmuls as kernels/experts/moe.py's grouped kernels do them for the plain experts
(decode-sized passes): the pairs sorted by expert into BLOCK_M blocks (moe.align_pairs), a
program a block of one expert and BLOCK_N output columns, only the touched experts' weights
read. Two differences, GPT-OSS's: the weights stay as stored, [E, in, out] (gate_up [E, H,
2I] with gate and up columns interleaved, down [E, I, H]), and the gate/up kernel's epilogue
adds the bias and applies the clamped SwiGLU (kernels/experts/biased_experts._clamped_swiglu), so the
[P, 2I] product is never written. The down bias goes into moe.combine.

At 256 decode rows torch._grouped_mm took 0.67 ms a Qwen3-30B-A3B layer to these kernels'
0.32 (H200, docs/performance.md); GPT-OSS's [E, in, out] weights read this way measured slower
than torch._grouped_mm (layers/biased_moe.DECODE_ROWS says by how much), so they run only where
DECODE_ROWS allows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.kernels.experts.biased_experts import _clamped_swiglu
from hybridflow.engine.kernels.experts.moe import (
    ExpertBlocks,
    _block_pairs,
    _store_pair_rows,
    grouped_launch,
)


@triton.jit
def _grouped_in_out_kernel(
    a_ptr, w_ptr, c_ptr, bias_ptr, sorted_ptr, block_expert_ptr, total_ptr, P, N, K,
    stride_am, stride_we, stride_wk, stride_cm, stride_be, alpha, limit,
    TOP_K: tl.constexpr, GATE_UP: tl.constexpr, FP32: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M block of sorted pairs (one expert) x BLOCK_N output columns, w [E, K, *]
    (columns contiguous).

    GATE_UP: a row of pair p is token p // TOP_K of a [T, K]; output column n takes w's
    columns 2n (gate) and 2n + 1 (up), each plus its bias, through the clamped SwiGLU; the
    rows follow the sorted order (c [capacity, N]). Else (down) a's rows are in sorted order
    and each valid row goes to c[pair] ([P, N])."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert, positions, pairs, valid, a_rows = _block_pairs(sorted_ptr, block_expert_ptr, pid_m,
                                                           P, TOP_K, GATE_UP, BLOCK_M)  # fmt: skip
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn_safe = tl.where(n_mask, rn, 0).to(tl.int64)
    if GATE_UP:
        w_cols = 2 * rn_safe
    else:
        w_cols = rn_safe
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + expert * stride_we + rk[:, None].to(tl.int64) * stride_wk + w_cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if FP32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        if GATE_UP:
            u = tl.load(w_ptrs + 1, mask=k_mask[:, None], other=0.0)
            if FP32:
                acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, u, acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dtype = c_ptr.dtype.element_ty
    if GATE_UP:  # the model's rounding: the product, then the bias added, then the SwiGLU
        bias = bias_ptr + expert * stride_be + w_cols
        gate_bias = tl.load(bias, mask=n_mask, other=0.0).to(tl.float32)
        up_bias = tl.load(bias + 1, mask=n_mask, other=0.0).to(tl.float32)
        gate = acc.to(dtype).to(tl.float32) + gate_bias[None, :]
        up = acc_up.to(dtype).to(tl.float32) + up_bias[None, :]
        gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)
        out = _clamped_swiglu(gate, up, alpha, limit, dtype)
        c = c_ptr + positions.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c, out.to(dtype), mask=n_mask[None, :])
    else:
        _store_pair_rows(c_ptr, acc, pairs, valid, rn, n_mask, stride_cm)


def biased_gate_up(x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor,
                   blocks: ExpertBlocks, alpha: float, limit: float) -> torch.Tensor:  # fmt: skip
    """x [T, H], gate_up [E, H, 2I] (interleaved), bias [E, 2I] -> the clamped SwiGLU of
    x @ gate_up[e] + bias[e], [capacity, I], rows in sorted order."""
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and bias.stride(1) == 1
    inner = gate_up.shape[2] // 2
    out = torch.empty(blocks.sorted_pairs.shape[0], inner, dtype=x.dtype, device=x.device)
    grid, launch = grouped_launch(blocks, inner, "gate_up", x)
    _grouped_in_out_kernel[grid](
        x, gate_up, out, bias, blocks.sorted_pairs, blocks.block_expert, blocks.total,
        blocks.pairs, inner, x.shape[1], x.stride(0), gate_up.stride(0), gate_up.stride(1),
        out.stride(0), bias.stride(0), float(alpha), float(limit), TOP_K=blocks.top_k,
        GATE_UP=True, FP32=x.dtype == torch.float32, **launch,
    )  # fmt: skip
    return out


def biased_down(act: torch.Tensor, down: torch.Tensor, blocks: ExpertBlocks) -> torch.Tensor:
    """act [capacity, I] (sorted order), down [E, I, H] -> [P, H] without the bias, row p =
    pair p's output."""
    assert act.stride(1) == 1 and down.stride(2) == 1 and not blocks.subset
    hidden = down.shape[2]
    out = torch.empty(blocks.pairs, hidden, dtype=act.dtype, device=act.device)
    grid, launch = grouped_launch(blocks, hidden, "down", act)
    _grouped_in_out_kernel[grid](
        act, down, out, act, blocks.sorted_pairs, blocks.block_expert, blocks.total,
        blocks.pairs, hidden, act.shape[1], act.stride(0), down.stride(0), down.stride(1),
        out.stride(0), 0, 0.0, 0.0, TOP_K=blocks.top_k, GATE_UP=False,
        FP32=act.dtype == torch.float32, **launch,
    )  # fmt: skip
    return out
