"""Reductions over the valid (mask == 1) elements of a tensor.

Masked positions are selected away with ``torch.where`` rather than multiplied by 0,
so that NaN/inf garbage in padding cannot leak into a result (``nan * 0 = nan``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_fill_zero(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` where ``mask`` is set, 0 elsewhere (same shape and dtype as values)."""
    return torch.where(
        mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)
    )


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    selected = masked_fill_zero(values, mask)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over valid elements; 0 (not NaN) when nothing is valid."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all valid elements (Bessel-corrected by default); 0 if < 2 valid."""
    count = mask.to(values.dtype).sum()
    mean = masked_mean(values, mask)
    squared_dev = masked_sum((values - mean) ** 2, mask)
    denominator = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    return squared_dev / denominator


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """``(x - mean_m(x)) * rsqrt(var_m(x) + 1e-8)`` with statistics over the whole batch.

    Valid positions are whitened; masked positions are returned as 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return masked_fill_zero(whitened, mask)
