"""Policy-gradient losses: PPO (asymmetric + dual clip), GSPO, CISPO, SAPO, GPG, Clip-Cov,
KL-Cov, GMPO (geo_mean). Formulas and how to choose one: ``docs/algorithms.md``.

Every loss is a function registered with ``@register_policy_loss(name)`` that returns a
per-token loss matrix ``[B, T]`` and a metrics dict; :func:`policy_loss` applies the
optional rollout importance weights and aggregates with :func:`agg_loss`. A loss whose
paper defines its own aggregation (GSPO, SAPO, GMPO) registers it with ``agg_mode=...``,
which then overrides ``loss_agg_mode``.

A user loss has the signature ``fn(*, old_logprobs, logprobs, advantages, response_mask,
clip_ratio_low, clip_ratio_high, clip_ratio_c, <its options>, **_) -> (loss_mat, metrics)``;
options must be declared by name: an option no loss declares is a ``ValueError`` (a
misspelt ``actor.policy_loss_kwargs`` key would otherwise be silently ignored).
Metrics are detached 0-d tensors (no host sync on CUDA); call ``float()`` when logging.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hybridflow.algos.aggregation import agg_loss
from hybridflow.algos.kl import LOG_RATIO_CLAMP
from hybridflow.algos.masked import masked_mean, masked_sum
from hybridflow.algos.registry import Registry

POLICY_LOSSES = Registry("policy loss", config_key="actor.policy_loss")
register_policy_loss = POLICY_LOSSES.register


def policy_loss(
    name: str,
    *,
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
    global_token_count: int | float | Tensor | None = None,
    global_seq_count: int | float | Tensor | None = None,
    norm_length: int | float | None = None,
    **variant_kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss of the loss registered as ``name``.

    Args:
        old_logprobs, logprobs, advantages, response_mask: ``[B, T]``; ``logprobs`` carries
            the gradient, the others are constants.
        loss_agg_mode: see :func:`agg_loss` (ignored by losses with their own mode).
        clip_ratio_low, clip_ratio_high: PPO clip ``[1 - low, 1 + high]`` (DAPO clip-higher
            when ``high > low``).
        clip_ratio_c: dual-clip bound for negative advantages (> 1).
        rollout_is_weights: ``[B, T]`` truncated importance weights (see
            :func:`rollout_is_weights`), multiplied into the per-token loss.
        global_token_count, global_seq_count, norm_length: whole-mini-batch normalisers for
            micro-batched / data-parallel training, passed to :func:`agg_loss`.
        variant_kwargs: extra options of a loss (e.g. ``clip_cov_ratio``, ``tau_pos``).
    Returns:
        ``(loss, metrics)``; metrics always include ``ppo_kl = mean_m(old_logp - logp)``.
    """
    entry = POLICY_LOSSES.get(name)
    _check_options(name, entry.fn, variant_kwargs)
    loss_mat, metrics = entry.fn(
        old_logprobs=old_logprobs,
        logprobs=logprobs,
        advantages=advantages,
        response_mask=response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        **variant_kwargs,
    )
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    loss = agg_loss(
        loss_mat,
        response_mask,
        entry.options.get("agg_mode") or loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_length=norm_length,
    )
    metrics = {key: value.detach() for key, value in metrics.items()}
    metrics["ppo_kl"] = masked_mean((old_logprobs - logprobs).detach(), response_mask)
    return loss, metrics


# ----------------------------------------------------------------------------- helpers

_COMMON_ARGUMENTS = frozenset(
    ("old_logprobs", "logprobs", "advantages", "response_mask")
    + ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
)


@functools.cache
def _declared_options(fn: Callable[..., Any]) -> frozenset[str]:
    """Keyword options a loss declares by name (its ``**_`` catch-all does not count)."""
    parameters = inspect.signature(fn).parameters.values()
    named = (p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    return frozenset(named) - _COMMON_ARGUMENTS


def _check_options(name: str, fn: Callable[..., Any], options: dict[str, Any]) -> None:
    """A misspelt ``actor.policy_loss_kwargs`` key must fail loudly, not be swallowed."""
    unknown = set(options) - _declared_options(fn)
    if unknown:
        accepted = ", ".join(sorted(_declared_options(fn))) or "none"
        raise ValueError(
            f"policy loss {name!r} has no option {', '.join(sorted(unknown))} "
            f"(actor.policy_loss_kwargs); its options: {accepted}"
        )


def importance_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """``exp(clamp(logp - logp_old, -20, 20))``: finite even for wild log-ratios."""
    return torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's ``max(-A rho, -A clip(rho))`` and the bool mask where the clip was chosen."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _fraction(flags: Tensor, response_mask: Tensor) -> Tensor:
    return masked_mean(flags.to(torch.float32), response_mask)


def _centred_product(advantages: Tensor, logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token ``(A - mean A)(logp - mean logp)`` (Cui et al. 2025, "The Entropy
    Mechanism of RL for Reasoning LMs"): tokens with large covariance drive entropy collapse.
    """
    logprobs = logprobs.detach()
    return (advantages - masked_mean(advantages, response_mask)) * (
        logprobs - masked_mean(logprobs, response_mask)
    )


# ----------------------------------------------------------------------------- losses


@register_policy_loss("vanilla")
def vanilla_loss(
    *,
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with dual clip for ``A < 0``
    (Ye et al. 2020): ``min(max(-A rho, -A clip(rho)), -A c)``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    ratio = importance_ratio(logprobs, old_logprobs)
    surrogate, clip_chosen = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(surrogate, dual_bound), surrogate)
    metrics = {
        "pg_clipfrac": _fraction(clip_chosen, response_mask),
        "pg_clipfrac_lower": _fraction((surrogate > dual_bound) & negative, response_mask),
    }
    return loss, metrics


@register_policy_loss("gspo", agg_mode="seq-mean-token-mean")
def gspo_loss(
    *,
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): the clip acts on the sequence ratio
    ``exp(mean_t(logp - logp_old))``; each token carries that value with its own gradient
    ``logp_t - sg(logp_t)``. Typical clip ranges are tiny (3e-4 / 4e-4).
    """
    seq_log_ratio = masked_mean((logprobs - old_logprobs).detach(), response_mask, dim=-1)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio[:, None]  # [B, T]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss, clip_chosen = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    return loss, {"pg_clipfrac": _fraction(clip_chosen, response_mask)}


@register_policy_loss("cispo")
def cispo_loss(
    *,
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stopped-gradient IS weight,
    ``-sg(clip(rho)) A logp``; no token is ever dropped from the gradient.
    """
    ratio = importance_ratio(logprobs, old_logprobs).detach()
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = -weight * advantages * logprobs
    return loss, {"pg_clipfrac": _fraction(weight != ratio, response_mask)}


@register_policy_loss("sapo", agg_mode="seq-mean-token-mean")
def sapo_loss(
    *,
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Qwen, 2025): a soft sigmoid gate instead of a hard clip,
    ``f(rho) = sigmoid(tau (rho - 1)) 4 / tau``; its gradient at ``rho = 1`` equals the plain
    policy gradient and decays smoothly off-policy (faster for negative advantages).
    """
    ratio = importance_ratio(logprobs, old_logprobs)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -gate * advantages, {}


@register_policy_loss("gpg")
def gpg_loss(*, logprobs: Tensor, advantages: Tensor, **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025): plain policy gradient ``-A logp``, no ratio, no clip."""
    return -advantages * logprobs, {}


@register_policy_loss("clip_cov")
def clip_cov_loss(
    *,
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025): PPO clip (no dual clip), plus a random
    ``clip_cov_ratio`` fraction of the valid tokens, drawn among the not-yet-clipped tokens
    whose covariance lies in ``[clip_cov_lb, clip_cov_ub]``, is detached (zero gradient).
    """
    valid = response_mask.bool()
    ratio = importance_ratio(logprobs, old_logprobs)
    surrogate, clip_chosen = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    covariance = _centred_product(advantages, logprobs, valid)
    candidates = valid & ~clip_chosen & (covariance >= clip_cov_lb) & (covariance <= clip_cov_ub)
    num_to_drop = max(int(clip_cov_ratio * int(valid.sum())), 1)
    # Uniform random subset of the candidates: the k largest of random keys (-1 = ineligible).
    keys = torch.rand(candidates.shape, generator=generator, device=candidates.device)
    keys = torch.where(candidates, keys, -1.0).flatten()
    top_keys, top_positions = torch.topk(keys, min(num_to_drop, keys.numel()))
    dropped = torch.zeros_like(keys, dtype=torch.bool)
    dropped[top_positions] = top_keys >= 0
    dropped = dropped.view_as(candidates)
    loss = torch.where(dropped, surrogate.detach(), surrogate)
    metrics = {
        "pg_clipfrac": _fraction(clip_chosen, valid),
        "pg_covfrac": _fraction(dropped, valid),
    }
    return loss, metrics


@register_policy_loss("kl_cov")
def kl_cov_loss(
    *,
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    kl_cov_ratio: float = 2e-3,
    ppo_kl_coef: float = 1.0,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025): unclipped ``-A rho``; the top ``kl_cov_ratio`` of valid
    tokens by covariance also pay ``ppo_kl_coef |logp - logp_old|``.
    """
    valid = response_mask.bool()
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss = -advantages * torch.exp(log_ratio)
    num_selected = int(kl_cov_ratio * int(valid.sum()))
    selected = torch.zeros_like(valid)
    if num_selected > 0:
        covariance = _centred_product(advantages, logprobs, valid)
        covariance = torch.where(valid, covariance, -torch.inf).flatten()
        selected.view(-1)[torch.topk(covariance, num_selected).indices] = True
        loss = loss + torch.where(selected, ppo_kl_coef * log_ratio.abs(), 0.0)
    return loss, {"pg_covfrac": _fraction(selected, valid)}


@register_policy_loss("geo_mean", agg_mode="seq-mean-token-sum")
def geo_mean_loss(
    *,
    old_logprobs: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025): geometric mean of token ratios per sequence, clipped per
    token in log space (``clip_ratio_low/high`` are log-space bounds, 0.4 in the paper).

    Per sequence ``L_i = -mean_t(A) exp(mean_t(clip_s(log rho)))`` where ``clip_s`` is the
    sign-aware (pessimistic) clip. Spread over the valid tokens as ``L_i / len_i`` so that
    ``seq-mean-token-sum`` yields the mean of ``L_i`` over sequences.
    """
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    # Pessimistic per token: for A > 0 the smaller log-ratio, for A < 0 the larger one.
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = response_mask.to(log_ratio.dtype).sum(-1).clamp(min=1)  # [B]
    seq_ratio = torch.exp(masked_sum(pessimistic, response_mask, dim=-1) / lengths)  # [B]
    seq_advantage = masked_sum(advantages, response_mask, dim=-1) / lengths  # [B]
    seq_loss = -seq_advantage * seq_ratio  # [B]
    loss_mat = (seq_loss / lengths)[:, None].expand_as(log_ratio)
    clipped = (sign * log_ratio) > (sign * clamped)
    return loss_mat, {"pg_clipfrac": _fraction(clipped, response_mask)}
