"""KL estimators, KL controllers and KL-in-reward.

Estimators of ``KL(pi || pi_ref)`` per token from ``d = logp - logp_ref`` (Schulman,
"Approximating KL divergence", http://joschu.net/blog/kl-approx.html):
``k1`` = d (unbiased, high variance), ``abs`` = |d|, ``k2`` = d^2 / 2 (its gradient is
the gradient of the true KL for samples from pi), ``k3`` = exp(-d) + d - 1 (unbiased,
low variance, always >= 0). A ``+`` suffix (``k1+``, ``k3+`` ...) keeps the named value in
the forward pass but back-propagates the k2 gradient (straight-through).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hybridflow.algos.masked import masked_fill_zero, masked_mean

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: finite in fp32, and far beyond any sane ratio
K3_CLAMP = 10.0


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _abs(log_ratio: Tensor) -> Tensor:
    return log_ratio.abs()


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: Tensor) -> Tensor:
    # x = log(pi_ref / pi); exp(x) - x - 1 >= 0. Clamps keep exp finite and bound outliers.
    x = torch.clamp(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(x) - x - 1, -K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}
KL_KINDS = tuple(KL_ESTIMATORS) + tuple(f"{name}+" for name in KL_ESTIMATORS)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate ``[B, T]`` of the policy from the reference policy.

    ``kind``: ``k1``/``kl``, ``abs``, ``k2``/``mse``, ``k3``/``low_var_kl``, each optionally
    with a ``+`` suffix: value of the named estimator, gradient of k2
    (``k2 - sg(k2) + sg(value)``).
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL kind {kind!r}; known: {', '.join(KL_KINDS)}")
    log_ratio = logprobs - ref_logprobs
    value = KL_ESTIMATORS[base](log_ratio)
    if not straight_through:
        return value
    k2 = _k2(log_ratio)
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """Constant KL coefficient ``beta``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers are used the same way)."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive ``beta`` (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences"):
    ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta (1 + e n_steps / horizon)``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL controller needs target_kl > 0 and horizon > 0, "
                f"got target_kl={target_kl}, horizon={horizon}"
            )
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target_kl = float(state.get("target_kl", self.target_kl))
        self.horizon = int(state.get("horizon", self.horizon))


KLController = FixedKLController | AdaptiveKLController


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> KLController:
    """``fixed`` or ``adaptive`` controller (config ``algorithm.kl_ctrl.type``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("algorithm.kl_ctrl.type=adaptive needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(
        f"unknown KL controller {kind!r} (algorithm.kl_ctrl.type); known: adaptive, fixed"
    )


def apply_kl_in_reward(
    token_level_scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    kl_ctrl: KLController,
    kind: str = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """``rewards = scores - beta * kl(old_logp, ref_logp)`` per valid token, then update beta.

    ``beta`` is the controller's value *before* this batch; the controller is then updated
    with the batch's mean per-sequence KL and ``n_steps = B`` (samples in the batch).
    Returns ``(token_level_rewards [B, T], metrics)``.
    """
    with torch.no_grad():
        kl = masked_fill_zero(kl_penalty(old_logprobs, ref_logprobs, kind), response_mask)
        beta = kl_ctrl.value
        rewards = token_level_scores - beta * kl
        current_kl = float(masked_mean(kl, response_mask, dim=-1).mean())
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
