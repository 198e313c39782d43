"""Rows quantized to e4m3 with a scale each: the Triton quantizer on CUDA, the torch reference
elsewhere. Apart from e4m3.py because the Triton kernel imports e4m3's constants."""

from __future__ import annotations

import torch

from hybridflow.engine.fp8.e4m3 import Fp8Rows, quantize_rows_reference


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """quantize_rows_reference on CUDA in one Triton launch (kernels/fp8_quant.py)."""
    if not x.is_cuda:
        return quantize_rows_reference(x)
    from hybridflow.engine.kernels.fp8_quant import quantize_rows_triton

    return quantize_rows_triton(x)
