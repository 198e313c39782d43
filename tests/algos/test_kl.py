"""KL estimators, straight-through variants, controllers, KL in the reward."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    kl_penalty,
)

# d = logp - logp_ref = (0.5, -1.0)
LOGP = torch.tensor([[0.0, -2.0]])
REF = torch.tensor([[-0.5, -1.0]])
EXPECTED = {
    "k1": [0.5, -1.0],
    "abs": [0.5, 1.0],
    "k2": [0.125, 0.5],  # d^2 / 2
    # x = -d = (-0.5, 1): e^x - x - 1 = 0.606531 + 0.5 - 1 = 0.106531; 2.718282 - 2 = 0.718282
    "k3": [math.exp(-0.5) - 0.5, math.e - 2.0],
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


@pytest.mark.parametrize("kind", list(EXPECTED) + list(ALIASES))
def test_estimator_values(kind):
    expected = torch.tensor([EXPECTED[ALIASES.get(kind, kind)]])
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), expected)


def test_k3_is_clamped_for_extreme_log_ratios():
    # d = -50: x = clamp(50, -20, 20) = 20 -> e^20 - 21 -> clamped to 10
    # d = +50: x = -20 -> e^-20 + 19 -> clamped to 10
    values = kl_penalty(torch.tensor([-50.0, 50.0]), torch.zeros(2), "k3")
    torch.testing.assert_close(values, torch.tensor([10.0, 10.0]))


@pytest.mark.parametrize("base", ["k1", "abs", "k2", "k3", "kl", "low_var_kl"])
def test_straight_through_value_and_gradient(base):
    logprobs = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).requires_grad_()
    ref = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    value = kl_penalty(logprobs, ref, base + "+")
    torch.testing.assert_close(value, kl_penalty(logprobs, ref, base))
    (grad,) = torch.autograd.grad(value.sum(), logprobs)
    (k2_grad,) = torch.autograd.grad(kl_penalty(logprobs, ref, "k2").sum(), logprobs)
    torch.testing.assert_close(grad, k2_grad)
    torch.testing.assert_close(grad, (logprobs - ref).detach())  # d(d^2/2)/dlogp = d
    if base not in ("k2", "mse"):
        (plain_grad,) = torch.autograd.grad(kl_penalty(logprobs, ref, base).sum(), logprobs)
        assert not torch.allclose(plain_grad, grad)  # the variant really changes the gradient


def test_unknown_kind_lists_known():
    with pytest.raises(ValueError, match="unknown KL kind 'k4'.*low_var_kl"):
        kl_penalty(LOGP, REF, "k4")
    assert "k3+" in KL_KINDS


def test_adaptive_controller_update_and_checkpoint():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    # KL 0.1 = 2x target -> error clip(1, -0.2, 0.2) = 0.2 -> beta = 0.1 * (1 + 0.2 * 10 / 100)
    controller.update(0.1, n_steps=10)
    assert controller.value == pytest.approx(0.102)
    # KL 0.04 -> error -0.2 -> beta = 0.102 * (1 - 0.2 * 50 / 100) = 0.0918
    controller.update(0.04, n_steps=50)
    assert controller.value == pytest.approx(0.0918)
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=1.0, horizon=1)
    restored.load_state_dict(controller.state_dict())
    assert restored.state_dict() == controller.state_dict()
    restored.update(0.05, n_steps=1)  # at target: unchanged
    assert restored.value == pytest.approx(0.0918)


def test_fixed_controller_and_builder():
    fixed = build_kl_controller("fixed", 0.3)
    fixed.update(10.0, n_steps=100)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    assert isinstance(build_kl_controller("adaptive", 0.1, 6.0, 10000), AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl and horizon"):
        build_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="unknown KL controller"):
        build_kl_controller("pid", 0.1)


def test_apply_kl_in_reward():
    # two samples, beta 0.5, k1: d = (0.2, 0.4, [masked 9]) and (-0.2, [masked], [masked])
    # rewards = scores - 0.5 d on valid tokens; per-sequence mean KL (0.3, -0.2) -> 0.05
    scores = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    old = torch.tensor([[0.2, 0.4, 9.0], [-0.2, 5.0, 5.0]])
    ref = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    controller = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_in_reward(scores, old, ref, mask, controller, "k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.8, 0.0], [2.1, 0.0, 0.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.05)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    # controller updated with KL 0.05, n_steps = 2: error -0.2 -> 0.5 * (1 - 0.2 * 2 / 10) = 0.48
    assert controller.value == pytest.approx(0.48)
