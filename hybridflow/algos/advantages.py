"""Advantage estimators: GAE, GRPO (+ Dr. GRPO, pass@k), RLOO, REINFORCE++ (+ baseline),
ReMax, OPO, GPG. Formulas and how to choose one: ``docs/algorithms.md``.

Conventions shared by every estimator:
- Inputs are ``[B, T]`` response-aligned tensors; ``response_mask`` is 1 on tokens that
  count. Values at masked positions never influence any output, and both outputs are 0
  there.
- Outcome estimators use the sequence score ``s_i = sum_t r[i, t] * m[i, t]`` and return
  ``A_i * m[i, t]`` as both advantages and returns.
- Group estimators read the group id of each sample from ``index`` (numpy array of any
  hashables, or an integer tensor). A group of one has no baseline: its mean is taken as
  0 and its std as 1, so its advantage is its own score (RLOO: ``s_i``).
- Everything runs under ``torch.no_grad``: advantages are targets, not graph nodes.

A user estimator is a function decorated with ``@register_advantage("name")``; it is
called with every keyword argument of :func:`compute_advantage` (take ``**_`` for the
ones you do not use) and returns ``(advantages, returns)``, both ``[B, T]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hybridflow.algos.groups import GroupStats, group_stats, group_sum
from hybridflow.algos.masked import masked_fill_zero, masked_whiten
from hybridflow.algos.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator", config_key="algorithm.adv_estimator")
register_advantage = ADVANTAGE_ESTIMATORS.register


def compute_advantage(
    name: str,
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: Tensor | None = None,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns with the estimator registered as ``name``.

    Args:
        token_level_rewards: ``[B, T]`` rewards; outcome rewards sit on the last valid token.
        response_mask: ``[B, T]`` 1 on tokens that count (bool or number).
        index: ``[B]`` group id per sample (group estimators only).
        values: ``[B, T]`` critic values (``gae`` only).
        gamma, lam: discount and GAE lambda.
        norm_adv_by_std_in_grpo: divide by the group std (False = Dr. GRPO).
        reward_baselines: ``[B]`` score of the greedy response (``remax`` only).
        epsilon: added to the std before dividing.
    Returns:
        ``(advantages [B, T], returns [B, T])`` in the rewards' dtype, 0 where masked.
    """
    estimator = ADVANTAGE_ESTIMATORS.get(name).fn
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(
            "token_level_rewards and response_mask must both be [B, T], got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )
    with torch.no_grad():
        return estimator(
            token_level_rewards=token_level_rewards,
            response_mask=response_mask,
            index=index,
            values=values,
            gamma=gamma,
            lam=lam,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            reward_baselines=reward_baselines,
            epsilon=epsilon,
        )


# ----------------------------------------------------------------------------- helpers


def sequence_scores(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """``s_i = sum_t r[i, t] * m[i, t]`` as float64 ``[B]``."""
    return masked_fill_zero(token_level_rewards.to(torch.float64), response_mask).sum(-1)


def _broadcast(per_sample: Tensor, like: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``A_i * m[i, t]`` in ``like``'s dtype, returned as (advantages, returns)."""
    advantages = per_sample.to(like.dtype)[:, None] * response_mask.to(like.dtype)
    return advantages, advantages.clone()


def _require(name: str, what: str, value: Any) -> None:
    if value is None:
        raise ValueError(f"advantage estimator {name!r} needs {what}, which was not given")


def _group_stats(name: str, scores: Tensor, index: Any) -> GroupStats:
    _require(name, "index (the group id / uid of each sample)", index)
    return group_stats(scores, index)


def _baseline_or_zero(stats: GroupStats) -> tuple[Tensor, Tensor]:
    """Per-sample group mean and std, with mean 0 / std 1 for groups of one."""
    singleton = stats.per_sample(stats.count) == 1
    mean = torch.where(singleton, 0.0, stats.per_sample(stats.mean))
    std = torch.where(singleton, 1.0, stats.per_sample(stats.std))
    return mean, std


def _reverse_discounted_sum(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """``G_t = m_t (r_t + gamma G_{t+1})``: the running return restarts after a masked token.

    A loop over time (not samples), vectorised across the batch; time-major copies make
    each step's slice contiguous.
    """
    valid_tb = response_mask.bool().T.contiguous()  # [T, B]
    rewards_tb = masked_fill_zero(rewards, response_mask).T.contiguous()  # [T, B]
    returns_tb = torch.zeros_like(rewards_tb)
    running = torch.zeros_like(rewards_tb[0])
    for t in range(rewards_tb.shape[0] - 1, -1, -1):
        running = torch.where(valid_tb[t], rewards_tb[t] + gamma * running, 0.0)
        returns_tb[t] = running
    return returns_tb.T.contiguous()


# ------------------------------------------------------------------------- estimators


@register_advantage("gae")
def gae_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None,
    gamma: float,
    lam: float,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), then whitened over the batch.

    Masked tokens inside a response (tool output in a multi-turn rollout) are skipped:
    the next value and next advantage are carried across them unchanged.
    """
    _require("gae", "values (critic values [B, T])", values)
    valid = response_mask.bool()
    rewards = masked_fill_zero(token_level_rewards, valid)
    values = masked_fill_zero(values.to(rewards.dtype), valid)
    valid_tb, rewards_tb, values_tb = (x.T.contiguous() for x in (valid, rewards, values))
    advantages_tb = torch.zeros_like(rewards_tb)  # [T, B]
    next_value = torch.zeros_like(rewards_tb[0])  # [B]
    next_advantage = torch.zeros_like(rewards_tb[0])  # [B]
    for t in range(rewards_tb.shape[0] - 1, -1, -1):
        delta = rewards_tb[t] + gamma * next_value - values_tb[t]
        advantage = delta + gamma * lam * next_advantage
        # On a masked token both carries pass through unchanged (output masked below).
        next_value = torch.where(valid_tb[t], values_tb[t], next_value)
        next_advantage = torch.where(valid_tb[t], advantage, next_advantage)
        advantages_tb[t] = next_advantage
    advantages = masked_fill_zero(advantages_tb.T, valid)
    returns = masked_fill_zero(advantages + values, valid)
    return masked_whiten(advantages, valid), returns


@register_advantage("grpo")
def grpo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    norm_adv_by_std_in_grpo: bool,
    epsilon: float,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): ``(s_i - mean_g) / (std_g + eps)``; Dr. GRPO without the std."""
    scores = sequence_scores(token_level_rewards, response_mask)
    mean, std = _baseline_or_zero(_group_stats("grpo", scores, index))
    advantage = scores - mean
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std + epsilon)
    return _broadcast(advantage, token_level_rewards, response_mask)


@register_advantage("grpo_passk")
def grpo_passk_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    norm_adv_by_std_in_grpo: bool,
    epsilon: float,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """Pass@k GRPO (Thrampoulidis et al. 2025): only each group's best sample is credited,
    with the gap to the runner-up ``r_max - r_second`` (over ``std_g + eps`` if normalising).
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    stats = _group_stats("grpo_passk", scores, index)
    if bool((stats.count < 2).any()):
        raise ValueError(
            "advantage estimator 'grpo_passk' needs at least 2 samples per group "
            "(set rollout.n >= 2)"
        )
    # Order samples by group, best first inside each group (ties: lowest sample index).
    by_score = torch.sort(scores, descending=True, stable=True).indices
    order = by_score[torch.sort(stats.ids[by_score], stable=True).indices]  # [B]
    group_start = torch.cumsum(stats.count, 0).long() - stats.count.long()  # [G]
    best, runner_up = order[group_start], order[group_start + 1]  # [G] sample indices
    gap = scores[best] - scores[runner_up]  # [G]
    if norm_adv_by_std_in_grpo:
        gap = gap / (stats.std + epsilon)
    advantage = torch.zeros_like(scores).index_put_((best,), gap)
    return _broadcast(advantage, token_level_rewards, response_mask)


@register_advantage("rloo")
def rloo_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: Any, **_: Any
) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): score minus the mean of the *other* samples,
    ``n/(n-1) (s_i - mean_g)``; a group of one keeps ``s_i``.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    stats = _group_stats("rloo", scores, index)
    count = stats.per_sample(stats.count)
    leave_one_out = count / (count - 1).clamp(min=1) * (scores - stats.per_sample(stats.mean))
    advantage = torch.where(count > 1, leave_one_out, scores)
    return _broadcast(advantage, token_level_rewards, response_mask)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, gamma: float, **_: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return, whitened over the whole batch."""
    returns = _reverse_discounted_sum(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: Any, **_: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: group mean subtracted, then whitened over the whole batch."""
    scores = sequence_scores(token_level_rewards, response_mask)
    mean, _std = _baseline_or_zero(_group_stats("reinforce_plus_plus_baseline", scores, index))
    centred, _ = _broadcast(scores - mean, token_level_rewards, response_mask)
    advantages = masked_whiten(centred, response_mask)
    return advantages, advantages.clone()


@register_advantage("remax")
def remax_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    reward_baselines: Tensor | None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): return-to-go minus the greedy response's score ``b_i``."""
    _require("remax", "reward_baselines (score of the greedy response, [B])", reward_baselines)
    valid = response_mask.bool()
    rewards = masked_fill_zero(token_level_rewards, valid)
    returns = masked_fill_zero(rewards.flip(-1).cumsum(-1).flip(-1), valid)
    baseline = reward_baselines.to(device=rewards.device, dtype=rewards.dtype).reshape(-1, 1)
    advantages = masked_fill_zero(returns - baseline, valid)
    return advantages, returns


@register_advantage("opo")
def opo_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: Any, **_: Any
) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025): baseline is the length-weighted group mean
    ``sum_j L_j s_j / sum_j L_j``; a group of one has baseline 0.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    stats = _group_stats("opo", scores, index)
    lengths = response_mask.to(torch.float64).sum(-1)
    num_groups = stats.count.shape[0]
    weighted = group_sum(lengths * scores, stats.ids, num_groups)
    total_length = group_sum(lengths, stats.ids, num_groups)
    baseline = weighted / total_length.clamp(min=1)
    baseline = torch.where(stats.per_sample(stats.count) == 1, 0.0, stats.per_sample(baseline))
    return _broadcast(scores - baseline, token_level_rewards, response_mask)


@register_advantage("gpg")
def gpg_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: Any, **_: Any
) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025): ``alpha (s_i - mean_g)`` with ``alpha = B / #{s_i != 0}``,
    which rescales the batch so that all-zero samples do not dilute the gradient.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    mean, _std = _baseline_or_zero(_group_stats("gpg", scores, index))
    alpha = scores.shape[0] / (scores != 0).sum().clamp(min=1)
    return _broadcast(alpha * (scores - mean), token_level_rewards, response_mask)
