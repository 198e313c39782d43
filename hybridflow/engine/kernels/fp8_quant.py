"""Per-row float8 e4m3 quantization of activations in one launch (fp8.py): a program per row
finds the row's max |x| over chunks of columns, then writes x / scale as e4m3 and the scale.
Matches fp8.quantize_rows_reference (fp32 arithmetic, the same clamp and cast)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, K, tiny,
                          BLOCK_K: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        mask = start + cols < K
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), tiny) / 448.0
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK_K):
        mask = start + cols < K
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
        tl.store(out_ptr + row * stride_o + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (x8 [M, K] e4m3, scale [M, 1] fp32)."""
    rows, depth = x.shape
    out = torch.empty((rows, depth), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = min(4096, triton.next_power_of_2(depth))
    _quantize_rows_kernel[(rows,)](x, out, scale, x.stride(0), out.stride(0), depth, 1e-12,
                                   BLOCK_K=block, num_warps=8 if block >= 2048 else 4)  # fmt: skip
    return out, scale
