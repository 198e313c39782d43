"""Group (uid) statistics without a Python loop over samples.

``index`` holds the group id of each sample: the ``n`` samples drawn from one prompt
share one id. It may be a numpy array (or list) of any hashable ids, e.g. uuid strings,
or an integer tensor. Ids are mapped to dense ``0..G-1`` and every statistic is a
scatter (``index_add_`` / ``scatter_reduce``) over those dense ids, in float64 so that
a group of identical scores gives a deviation of exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor


def dense_group_ids(index: Any, batch_size: int, device: torch.device) -> tuple[Tensor, int]:
    """Map group ids to dense ``0..G-1``. Returns ``(ids [B] int64 on device, G)``."""
    if isinstance(index, Tensor):
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise ValueError(f"index tensor must hold integer group ids, got dtype {index.dtype}")
        if index.dim() != 1 or index.shape[0] != batch_size:
            raise ValueError(f"index must have shape [{batch_size}], got {tuple(index.shape)}")
        # torch.unique stays on the tensor's device: no host round trip on CUDA.
        uniques, inverse = torch.unique(index, return_inverse=True)
        return inverse.to(device=device, dtype=torch.long), int(uniques.numel())

    array = np.asarray(index)
    if array.ndim != 1 or array.shape[0] != batch_size:
        raise ValueError(f"index must have shape [{batch_size}], got {array.shape}")
    try:
        uniques, inverse = np.unique(array, return_inverse=True)
        num_groups = len(uniques)
    except TypeError:
        # Mixed / unorderable hashables (np.unique sorts): fall back to first-seen order.
        first_seen: dict[Any, int] = {}
        inverse = np.fromiter(
            (first_seen.setdefault(key, len(first_seen)) for key in array.tolist()),
            dtype=np.int64,
            count=batch_size,
        )
        num_groups = len(first_seen)
    ids = torch.as_tensor(np.asarray(inverse, dtype=np.int64).reshape(-1), device=device)
    return ids, num_groups


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics of a ``[B]`` score vector, indexed by dense group id."""

    ids: Tensor  # [B] int64, dense group id of each sample
    count: Tensor  # [G] float64, samples per group
    mean: Tensor  # [G] float64
    std: Tensor  # [G] float64, unbiased; 0 for a group of one

    def per_sample(self, group_values: Tensor) -> Tensor:
        """Broadcast a ``[G]`` per-group value back to the ``[B]`` samples."""
        return group_values[self.ids]


def group_sum(values: Tensor, ids: Tensor, num_groups: int) -> Tensor:
    """``[G]`` sums of ``values [B]`` per dense group id."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, ids, values
    )


def group_stats(scores: Tensor, index: Any) -> GroupStats:
    """Count, mean and unbiased std of ``scores [B]`` within each group of ``index``."""
    scores = scores.to(torch.float64)
    ids, num_groups = dense_group_ids(index, scores.shape[0], scores.device)
    count = group_sum(torch.ones_like(scores), ids, num_groups)
    mean = group_sum(scores, ids, num_groups) / count
    # Two-pass variance: exact zero for identical scores, no catastrophic cancellation.
    deviation = scores - mean[ids]
    var = group_sum(deviation * deviation, ids, num_groups) / (count - 1).clamp(min=1)
    return GroupStats(ids=ids, count=count, mean=mean, std=var.sqrt())


def groups_with_signal(scores: Tensor | np.ndarray, index: Any) -> Tensor:
    """DAPO dynamic sampling: which samples belong to a group whose scores differ.

    A group where every sample got the same score (all right, all wrong, or a group of
    one) gives zero advantage under group-relative estimators, so it carries no
    learning signal and DAPO drops it.

    Args:
        scores: ``[B]`` sequence scores (tensor or numpy array).
        index: ``[B]`` group ids (numpy array of hashables or an integer tensor).
    Returns:
        ``[B]`` bool tensor (on the scores' device), True for samples to keep.
    """
    scores_t = torch.as_tensor(scores).to(torch.float64).reshape(-1)
    ids, num_groups = dense_group_ids(index, scores_t.shape[0], scores_t.device)
    group_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=scores_t.device)
    group_min = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=scores_t.device)
    group_max = group_max.scatter_reduce(0, ids, scores_t, reduce="amax")
    group_min = group_min.scatter_reduce(0, ids, scores_t, reduce="amin")
    return (group_max > group_min)[ids]
