"""Per-row float8 e4m3 quantization of activations (fp8.py): a program per row finds the row's
max |x|, then writes x / scale as e4m3 and the scale. Matches fp8.quantize_rows_reference
(fp32 arithmetic, the scale times 1/448, IEEE division by it, the same clamp, round to nearest
even, the sign of zero) bit for bit.

The standalone kernel here quantizes the attention output in front of o_proj; the norms and
SiLU*up in rowwise.py write their outputs through the same helpers (row_scale, e4m3_values)
so that each of them hands its matmul e4m3 rows without a launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.fp8.e4m3 import E4M3, INV_E4M3_MAX, TINY, Fp8Rows

_INV_E4M3_MAX = tl.constexpr(INV_E4M3_MAX)


@triton.jit
def row_scale(amax, tiny):
    """A row's scale from its max |x| (fp32): max(amax, tiny) * (1/448), as the reference
    computes it (fp8/e4m3.INV_E4M3_MAX says why not a division)."""
    return tl.maximum(amax, tiny) * _INV_E4M3_MAX


@triton.jit
def _round_to_e4m3(y):
    """fp32 y within ±448 -> the nearest e4m3fn value, ties to even, still as fp32: what
    torch's cast and the GPU's cvt.rn.satfinite give. The cast that follows is then exact,
    so the Triton interpreter (whose own fp8 cast took 31.53 to 16, not 32) agrees with the
    GPU and the CPU tests can check bits."""
    bits = y.to(tl.int32, bitcast=True)
    lowest_kept = (bits >> 20) & 1  # 3 of the 23 mantissa bits stay
    normal = ((bits + 0x7FFFF + lowest_kept) & -0x100000).to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 is subnormal, multiples of 2^-9: adding 1.5 * 2^14 leaves fp32 that
    # resolution and rounds to nearest even there
    magnitude = ((tl.abs(y) + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    # y's sign bit put back with an or: `-x` compiles to 0 - x on the GPU, which makes -0 +0
    subnormal = (magnitude | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def e4m3_values(x, scale):
    """fp32 x / scale, clamped to ±448 and rounded to e4m3 (fp32 holding e4m3 values; the
    store casts them exactly). The division is IEEE-rounded (div_rn) as torch's tensor
    division is: Triton's `/` compiles to div.full.f32 (2 ulp), which moves values near an
    e4m3 tie to the other side now and then."""
    y = tl.math.div_rn(x, scale)
    return _round_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))


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
    scale = row_scale(tl.max(amax, axis=0), tiny)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK_K):
        mask = start + cols < K
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
        y = e4m3_values(x.to(tl.float32), scale)
        tl.store(out_ptr + row * stride_o + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def empty_rows(rows: int, width: int, device: torch.device) -> Fp8Rows:
    """Uninitialised e4m3 rows [rows, width] and their scales, for a kernel to fill."""
    return Fp8Rows(torch.empty((rows, width), dtype=E4M3, device=device),
                   torch.empty((rows, 1), dtype=torch.float32, device=device))  # fmt: skip


def quantize_rows_triton(x: torch.Tensor) -> Fp8Rows:
    """x [M, K] (last dim contiguous) -> (x8 [M, K] e4m3, scale [M, 1] fp32)."""
    rows, depth = x.shape
    out, scale = empty_rows(rows, depth, x.device)
    block = min(4096, triton.next_power_of_2(depth))
    _quantize_rows_kernel[(rows,)](x, out, scale, x.stride(0), out.stride(0), depth, TINY,
                                   BLOCK_K=block, num_warps=8 if block >= 2048 else 4)  # fmt: skip
    return Fp8Rows(out, scale)
