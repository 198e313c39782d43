"""The float8 e4m3 format of the fp8 rollout (matmul.py): its range, how a row's scale is
taken, and Fp8Rows, activations quantized per row. The Triton kernels that write or read
such rows (kernels/fp8_quant.py, kernels/rowwise.py) and the matmuls in matmul.py share it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Scales are max|x| times this, not max|x| / 448: torch on CUDA divides by a Python scalar as
# a multiply by its reciprocal (CPU divides), so only the multiply is one rounding everywhere,
# the kernels' included.
INV_E4M3_MAX = 1.0 / E4M3_MAX
TINY = 1e-12  # an all-zero row gets a finite scale (and quantizes to zeros)


class Fp8Rows(NamedTuple):
    """Activations quantized per row (quantize_rows, or a kernel that wrote them so):
    x ≈ values * scale."""

    values: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M, 1] fp32


def quantize_rows_reference(x: torch.Tensor) -> Fp8Rows:
    """x [M, K] -> (x8 [M, K] e4m3, scale [M, 1] fp32) with x ≈ x8 * scale per row."""
    xf = x.float()
    return quantize_rows_by_amax(xf, xf.abs().amax(dim=-1, keepdim=True))


def quantize_rows_by_amax(x: torch.Tensor, amax: torch.Tensor) -> Fp8Rows:
    """quantize_rows_reference with each row's scale taken from amax [M, 1] fp32: the row's
    own, or the whole row's where x holds a part of its columns (a tensor-parallel shard)."""
    scale = amax.clamp(min=TINY) * INV_E4M3_MAX
    return Fp8Rows((x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale)
