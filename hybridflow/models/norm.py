"""RMSNorm with HF's parameter name (``weight``).

``grad_mesh``: under tensor parallelism, a norm applied with one weight to every head of a
layer (qk-norm, Gated DeltaNet's output norm) sees its rank's heads only; then its weight's
gradient is summed over the mesh (models/sharding/tensor_parallel.py sets it; None: whole).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.sharding.grad_sum import summed_grad


def _weight(norm: nn.Module) -> torch.Tensor:
    return norm.weight if norm.grad_mesh is None else summed_grad(norm.weight, norm.grad_mesh)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.grad_mesh = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm accumulates in fp32 and is one fused kernel on CUDA, but only when input
        # and weight share a dtype: under bf16 autocast with fp32 master weights (the unsharded
        # training path) it fell back to an unfused composite (torch warned on the H200). The
        # cast matches FSDP2's mixed precision, which hands the layer bf16 weights.
        weight = _weight(self)
        weight = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from 1 (``x * (1 + weight)``, computed in
    fp32): Qwen3.5's and Qwen3-Next's layer, final and q/k norms. The weight starts at 0."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.grad_mesh = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + _weight(self).float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times silu(gate): Gated DeltaNet's output norm
    (HF's ``linear_attn.norm``). The weight multiplies in the input dtype, the gate in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.grad_mesh = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return (_weight(self).to(x.dtype) * normed * F.silu(gate.float())).to(x.dtype)


def make_rms_norm(dim: int, eps: float, zero_centered: bool) -> nn.Module:
    return ZeroCenteredRMSNorm(dim, eps) if zero_centered else RMSNorm(dim, eps)
