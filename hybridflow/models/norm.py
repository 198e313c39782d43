"""RMSNorm with HF's parameter name (``weight``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm accumulates in fp32 and is one fused kernel on CUDA, but only when input
        # and weight share a dtype: under bf16 autocast with fp32 master weights (the unsharded
        # training path) it fell back to an unfused composite (torch warned on the H200). The
        # cast matches FSDP2's mixed precision, which hands the layer bf16 weights.
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
