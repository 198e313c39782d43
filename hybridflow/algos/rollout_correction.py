"""Truncated importance sampling for rollout/trainer mismatch.

The rollout engine (other kernels, other precision) samples from a policy whose
log-probs differ slightly from the trainer's ``old_logprobs``; reweighting each token by
``min(pi_old / pi_rollout, C)`` corrects the resulting bias while the cap ``C`` bounds the
variance (truncated IS, Ionides 2008; "Your efficient RL framework secretly brings you
off-policy RL training", Yao et al. 2025).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algos.kl import LOG_RATIO_CLAMP
from hybridflow.algos.masked import masked_fill_zero, masked_mean


def rollout_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, cap: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights ``w = min(exp(old_logp - rollout_logp), cap)``, 0 where masked.

    Args:
        old_logprobs: ``[B, T]`` trainer log-probs of the sampled tokens.
        rollout_logprobs: ``[B, T]`` log-probs reported by the rollout engine.
        response_mask: ``[B, T]``.
        cap: truncation ``C`` (> 0).
    Returns:
        ``(weights [B, T] detached, metrics)``; pass the weights to
        ``policy_loss(..., rollout_is_weights=weights)``.
    """
    if cap <= 0:
        raise ValueError(f"rollout importance-weight cap must be > 0, got {cap}")
    with torch.no_grad():
        log_ratio = torch.clamp(old_logprobs - rollout_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        weights = masked_fill_zero(torch.clamp(ratio, max=cap), response_mask)
        metrics = {
            "rollout_is/mean": masked_mean(weights, response_mask),
            "rollout_is/capped_frac": masked_mean((ratio > cap).float(), response_mask),
            "rollout_is/abs_log_ratio": masked_mean(log_ratio.abs(), response_mask),
        }
    return weights, metrics
