"""The row-wise pieces of GPT-OSS's experts around torch._grouped_mm (layers/biased_moe.py):
the gate/up bias and the clamped SwiGLU in one pass over the gate_up product, and the down
bias folded into the weighted combine (kernels/experts/moe.combine's bias).

The model (models/mlps/biased_experts.py, through models/moe.moe_experts) adds each bias as
a gathered [P, 2I] (then [P, H]) tensor and runs the clamped SwiGLU as eight elementwise
passes; at 32,768 prefill tokens of gpt-oss-20b (P = 131,072 pairs, 2I = 5,760) those move
~20 GB a layer, this kernel reads the product once and writes the activation once (~2.3 GB).
Each step is rounded to the activation dtype where the model's torch ops round it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns of the activation a program writes (2,880 for gpt-oss-20b: 3 programs a row).
BLOCK = 1024


@triton.jit
def _clamped_swiglu(gate, up, alpha, limit, dtype: tl.constexpr):
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), over
    fp32 gate/up already rounded to dtype, each step rounded where the model's torch ops
    round -> fp32 (of dtype's values)."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    scaled = (gate * alpha).to(dtype).to(tl.float32)
    tail = tl.exp(-tl.abs(scaled))  # in (0, 1]: no overflow for a gate far below 0
    sig = tl.where(scaled >= 0, 1.0 / (1.0 + tail), tail / (1.0 + tail))
    sig = sig.to(dtype).to(tl.float32)
    glu = (gate * sig).to(dtype).to(tl.float32)
    return (up + 1.0).to(dtype).to(tl.float32) * glu


@triton.jit
def _bias_clamped_swiglu_kernel(
    x_ptr, bias_ptr, expert_ptr, out_ptr, stride_x, stride_b, stride_o, inner, alpha, limit,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """out[r, i] = _clamped_swiglu(gate, up), where gate = x[r, 2i] + bias[e, 2i] and up =
    x[r, 2i + 1] + bias[e, 2i + 1] (e: row r's expert)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    dtype = out_ptr.dtype.element_ty
    expert = tl.load(expert_ptr + row).to(tl.int64)
    x = x_ptr + row * stride_x + 2 * cols
    b = bias_ptr + expert * stride_b + 2 * cols
    gate = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + 1, mask=mask, other=0.0).to(tl.float32)
    gate = (gate + tl.load(b, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    up = (up + tl.load(b + 1, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    out = _clamped_swiglu(gate, up, alpha, limit, dtype)
    tl.store(out_ptr + row * stride_o + cols, out.to(dtype), mask=mask)


def bias_clamped_swiglu(gate_up: torch.Tensor, bias: torch.Tensor, row_experts: torch.Tensor,
                        alpha: float, limit: float) -> torch.Tensor:  # fmt: skip
    """gate_up [M, 2I] (gate and up columns interleaved, contiguous rows), bias [E, 2I],
    row_experts [M] (each row's expert) -> [M, I] in gate_up's dtype: models/mlps/
    biased_experts.clamped_swiglu(gate_up + bias[row_experts])."""
    rows, width = gate_up.shape
    assert gate_up.stride(1) == 1 and bias.stride(1) == 1 and width % 2 == 0
    inner = width // 2
    out = torch.empty(rows, inner, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _bias_clamped_swiglu_kernel[(rows, triton.cdiv(inner, BLOCK))](
            gate_up, bias, row_experts, out, gate_up.stride(0), bias.stride(0), out.stride(0),
            inner, float(alpha), float(limit), BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
    return out
