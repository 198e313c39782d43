"""Clipped value loss for the critic (PPO, Schulman et al. 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algos.aggregation import agg_loss
from hybridflow.algos.masked import masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    *,
    global_token_count: int | float | Tensor | None = None,
    global_seq_count: int | float | Tensor | None = None,
    norm_length: int | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))``.

    Args:
        values: ``[B, T]`` current critic values (carry the gradient).
        old_values: ``[B, T]`` values when the batch was collected.
        returns: ``[B, T]`` targets from the advantage estimator.
        response_mask: ``[B, T]``.
        cliprange_value: ``c``; the new value may move at most ``c`` from the old one
            before the clipped (pessimistic) branch takes over.
    Returns:
        ``(loss, {"vf_clipfrac", "vpred_mean"})``.
    """
    clipped_values = old_values + torch.clamp(
        values - old_values, -cliprange_value, cliprange_value
    )
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    loss_mat = torch.maximum(unclipped_error, clipped_error)
    loss = 0.5 * agg_loss(
        loss_mat,
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_length=norm_length,
    )
    metrics = {
        "vf_clipfrac": masked_mean((clipped_error > unclipped_error).float(), response_mask),
        "vpred_mean": masked_mean(values.detach(), response_mask),
    }
    return loss, metrics
