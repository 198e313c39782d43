"""Policy losses: hand-computed values and gradients, stability, padding, registry."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos import POLICY_LOSSES, policy_loss, register_policy_loss, rollout_is_weights

ALL_LOSSES = ["vanilla", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean"]


def loss_and_grad(name, logprobs, old_logprobs, advantages, mask, **kwargs):
    logprobs = logprobs.clone().requires_grad_()
    loss, metrics = policy_loss(
        name,
        old_logprobs=old_logprobs,
        logprobs=logprobs,
        advantages=advantages,
        response_mask=mask,
        **kwargs,
    )
    loss.backward()
    return loss.detach(), logprobs.grad, metrics


def test_vanilla_hand_computed():
    # four tokens, clip 0.2, dual clip c = 3:
    #   A=+1, rho=1.5: L1=-1.5, L2=-1.2 -> max -1.2 (clipped, no gradient)
    #   A=+1, rho=0.5: L1=-0.5, L2=-0.8 -> max -0.5 (gradient -A rho = -0.5)
    #   A=-1, rho=0.5: L1=+0.5, L2=+0.8 -> max +0.8 (clipped, no gradient)
    #   A=-1, rho=5.0: L1=+5.0, L2=+1.2 -> max 5.0, dual clip min(5, -A c = 3) = 3 (no gradient)
    # token-mean: (-1.2 - 0.5 + 0.8 + 3) / 4 = 0.525
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 0.5, 5.0]]))
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, grad, metrics = loss_and_grad("vanilla", logprobs, old, advantages, torch.ones(1, 4))
    assert float(loss) == pytest.approx(0.525, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5 / 4, 0.0, 0.0]]))
    assert float(metrics["pg_clipfrac"]) == pytest.approx(0.5)  # tokens 0 and 2
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(0.25)  # token 3
    # ppo_kl = mean(old - logp) = -(log 1.5 + log 0.5 + log 0.5 + log 5) / 4
    expected_kl = -(math.log(1.5) + 2 * math.log(0.5) + math.log(5.0)) / 4
    assert float(metrics["ppo_kl"]) == pytest.approx(expected_kl, abs=1e-6)


def test_vanilla_clip_higher_is_asymmetric():
    # DAPO clip-higher 0.2 / 0.28: A=+1, rho=1.5 -> clipped to 1.28 -> L = -1.28
    #                              A=-1, rho=0.5 -> clipped to 0.80 -> L = +0.8
    # token-mean (-1.28 + 0.8) / 2 = -0.24
    loss, _, _ = loss_and_grad(
        "vanilla",
        torch.log(torch.tensor([[1.5, 0.5]])),
        torch.zeros(1, 2),
        torch.tensor([[1.0, -1.0]]),
        torch.ones(1, 2),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    assert float(loss) == pytest.approx(-0.24, abs=1e-6)


def test_vanilla_rejects_dual_clip_below_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        loss_and_grad("vanilla", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_ratio_c=1.0)  # fmt: skip


def test_gspo_hand_computed():
    # seq 0: log-ratios (0.1, 0.3), A=+1 -> seq ratio exp(0.2) = 1.2214 -> clipped to 1.2:
    #   every token -1.2, no gradient
    # seq 1: log-ratios (0, -0.1, [masked 5.0]), A=-1 -> exp(-0.05) = 0.951229 inside the clip:
    #   every token +0.951229; gradient per token = rho * (1/2 tokens) * (1/2 seqs) = 0.237807
    # seq-mean-token-mean: (-1.2 + 0.951229) / 2 = -0.1243855
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[0.1, 0.3, 0.0], [0.0, -0.1, 5.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, grad, metrics = loss_and_grad("gspo", logprobs, old, advantages, mask)
    assert float(loss) == pytest.approx(-0.1243855, abs=1e-6)
    rho = math.exp(-0.05)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0, 0], [rho / 4, rho / 4, 0]]))
    assert float(metrics["pg_clipfrac"]) == pytest.approx(0.5)


def test_gspo_ignores_loss_agg_mode():
    args = (torch.tensor([[0.1, 0.0, 0.0]]), torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([[1.0, 1, 0]]))  # fmt: skip
    token_mean, _, _ = loss_and_grad("gspo", *args, loss_agg_mode="token-mean")
    seq_sum, _, _ = loss_and_grad("gspo", *args, loss_agg_mode="seq-mean-token-sum")
    assert float(token_mean) == pytest.approx(float(seq_sum))


def test_cispo_hand_computed():
    # token 0: A=2, rho=1.5 -> weight clip to 1.2 (no gradient through it); logp=-0.5
    #   L = -1.2 * 2 * (-0.5) = 1.2, dL/dlogp = -2.4
    # token 1: A=-1, rho=0.5 -> weight 0.8; logp=-2 -> L = -0.8 * -1 * -2 = -1.6, dL/dlogp = 0.8
    # token-mean: (1.2 - 1.6) / 2 = -0.2; gradients / 2
    logprobs = torch.tensor([[-0.5, -2.0]])
    old = logprobs - torch.log(torch.tensor([[1.5, 0.5]]))
    loss, grad, metrics = loss_and_grad(
        "cispo", logprobs, old, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2)
    )
    assert float(loss) == pytest.approx(-0.2, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-1.2, 0.4]]))
    assert float(metrics["pg_clipfrac"]) == 1.0


def test_sapo_hand_computed():
    # one sequence of three tokens:
    #   A=+1, rho=1: tau=1,    f = sigmoid(0) * 4 = 2        -> L = -2,       dL/dlogp = -1
    #   A=-1, rho=1: tau=1.05, f = 0.5 * 4 / 1.05 = 1.904762 -> L = +1.904762, dL/dlogp = +1
    #   A=+1, rho=2: tau=1,    f = sigmoid(1) * 4 = 2.924234 -> L = -2.924234,
    #       dL/dlogp = -4 sigmoid(1)(1 - sigmoid(1)) * rho = -4 * 0.196612 * 2 = -1.572895
    # seq-mean-token-mean over one sequence: sum / 3, gradients / 3
    logprobs = torch.tensor([[-1.0, -1.0, -1.0 + math.log(2.0)]])
    old = torch.full((1, 3), -1.0)
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    loss, grad, _ = loss_and_grad("sapo", logprobs, old, advantages, torch.ones(1, 3))
    assert float(loss) == pytest.approx((-2 + 1.904762 - 2.924234) / 3, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 1.0, -1.572895]]) / 3, atol=1e-5, rtol=0)


def test_gpg_hand_computed():
    # L = -A logp: (-(2 * -1) + -(-1 * -3)) / 2 = (2 - 3) / 2 = -0.5; dL/dlogp = -A / 2
    loss, grad, _ = loss_and_grad(
        "gpg", torch.tensor([[-1.0, -3.0]]), torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2)
    )  # fmt: skip
    assert float(loss) == pytest.approx(-0.5)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.5]]))


def cov_case():
    # A = (3, 0, 0, -3), mean 0; logp = (-1, -2, -2, -3), mean -2
    # cov = A_c * logp_c = (3 * 1, 0, 0, -3 * -1) = (3, 0, 0, 3): tokens 0 and 3 in [1, 5]
    logprobs = torch.tensor([[-1.0, -2.0, -2.0, -3.0]])
    advantages = torch.tensor([[3.0, 0.0, 0.0, -3.0]])
    return logprobs, logprobs.clone(), advantages, torch.ones(1, 4)


def test_clip_cov_detaches_one_random_candidate():
    # 4 valid tokens * 2e-4 -> int 0 -> at least 1 token detached, chosen among {0, 3}
    # ratio 1 everywhere -> gradient of the others is -A rho / 4: token 0: -0.75, token 3: +0.75
    seen = set()
    for seed in range(12):
        generator = torch.Generator().manual_seed(seed)
        _, grad, metrics = loss_and_grad("clip_cov", *cov_case(), generator=generator)
        zeroed = {t for t in (0, 3) if grad[0, t] == 0}
        assert len(zeroed) == 1
        kept = ({0, 3} - zeroed).pop()
        assert float(grad[0, kept]) == pytest.approx(-[3.0, 0, 0, -3.0][kept] / 4)
        assert float(metrics["pg_covfrac"]) == pytest.approx(0.25)
        seen |= zeroed
    assert seen == {0, 3}  # the choice is random, not always the same token


def test_clip_cov_never_picks_an_already_clipped_token():
    # token 0 gets rho = 2 -> clipped by PPO -> not a candidate: token 3 is always detached
    logprobs, old, advantages, mask = cov_case()
    old[0, 0] -= math.log(2.0)
    for seed in range(5):
        _, grad, _ = loss_and_grad(
            "clip_cov",
            logprobs,
            old,
            advantages,
            mask,
            generator=torch.Generator().manual_seed(seed),
        )
        assert grad[0, 3] == 0 and grad[0, 0] == 0  # 0 by PPO clip, 3 by Clip-Cov


def test_kl_cov_hand_computed():
    # A = (2, 0, 0, -2), logp = (-1, -2, -2, -2.5): means 0 and -1.875
    # cov = (2 * 0.875, 0, 0, -2 * -0.625) = (1.75, 0, 0, 1.25); ratio 0.25 * 4 tokens = 1 -> token 0
    # token 0: log-ratio 0.1 -> L = -2 e^0.1 + 1.0 * |0.1| = -2.210342 + 0.1 = -2.110342
    #          dL/dlogp = -2 e^0.1 + 1 = -1.210342
    # token 3: log-ratio 0 -> L = +2, dL/dlogp = +2; tokens 1, 2: A = 0
    # token-mean: (-2.110342 + 2) / 4 = -0.0275855
    logprobs = torch.tensor([[-1.0, -2.0, -2.0, -2.5]])
    old = logprobs - torch.tensor([[0.1, 0.0, 0.0, 0.0]])
    advantages = torch.tensor([[2.0, 0.0, 0.0, -2.0]])
    loss, grad, metrics = loss_and_grad(
        "kl_cov", logprobs, old, advantages, torch.ones(1, 4), kl_cov_ratio=0.25
    )
    assert float(loss) == pytest.approx(-0.0275855, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.210342, 0.0, 0.0, 2.0]]) / 4)
    assert float(metrics["pg_covfrac"]) == pytest.approx(0.25)


def test_geo_mean_hand_computed():
    # clip +-0.4 in log space
    # seq 0, A=+1, log-ratios (0.5, -0.1): pessimistic = min(lr, clamp) = (0.4, -0.1)
    #   ratio exp(0.15) = 1.161834 -> L0 = -1.161834
    # seq 1, A=-1, log-ratios (0.5, -0.6): pessimistic = max(lr, clamp) = (0.5, -0.4)
    #   ratio exp(0.05) = 1.051271 -> L1 = +1.051271
    # loss = mean over sequences = -0.0552815
    # gradient: d/dlogp_t = -A ratio / 2 tokens / 2 seqs on unclipped tokens, 0 on clipped ones
    logprobs = torch.tensor([[0.5, -0.1], [0.5, -0.6]])
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, grad, metrics = loss_and_grad(
        "geo_mean", logprobs, torch.zeros(2, 2), advantages, torch.ones(2, 2),
        clip_ratio_low=0.4, clip_ratio_high=0.4,
    )  # fmt: skip
    assert float(loss) == pytest.approx(-0.0552815, abs=1e-6)
    expected = torch.tensor([[0.0, -1.161834 / 4], [1.051271 / 4, 0.0]])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(0.5)


def test_rollout_is_weights_hand_computed_and_applied():
    # old - rollout = (log 1.5, log 3, 0, [masked]) -> min(ratio, 2) = (1.5, 2, 1, 0)
    rollout = torch.zeros(1, 4)
    old = torch.log(torch.tensor([[1.5, 3.0, 1.0, 9.0]]))
    mask = torch.tensor([[1.0, 1, 1, 0]])
    weights, metrics = rollout_is_weights(old, rollout, mask, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 2.0, 1.0, 0.0]]))
    assert float(metrics["rollout_is/capped_frac"]) == pytest.approx(1 / 3)
    # gpg with A = 1, logp = -1: per-token loss 1, weighted (1.5, 2, 1) -> mean 1.5
    loss, grad, _ = loss_and_grad(
        "gpg", torch.full((1, 4), -1.0), old, torch.ones(1, 4), mask, rollout_is_weights=weights
    )
    assert float(loss) == pytest.approx(1.5)
    torch.testing.assert_close(grad, -weights / 3)


def test_rollout_is_weights_extreme_log_ratios():
    # +-50: exp clamped at 20 -> capped at C; exp(-20) ~ 2e-9 -> finite, tiny
    old = torch.tensor([[50.0, -50.0]])
    weights, metrics = rollout_is_weights(old, torch.zeros(1, 2), torch.ones(1, 2), cap=3.0)
    assert weights[0, 0] == 3.0 and 0 < weights[0, 1] < 1e-8
    assert all(torch.isfinite(value) for value in metrics.values())


# ------------------------------------------------------------------------------ invariances


def random_inputs(seed, batch=4, width=7):
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, width, generator=generator) > 0.3).float()
    mask[:, 0] = 1
    logprobs = -torch.rand(batch, width, generator=generator) * 3
    old = logprobs + 0.3 * torch.randn(batch, width, generator=generator)
    advantages = torch.randn(batch, 1, generator=generator).expand(batch, width).contiguous()
    return logprobs, old, advantages, mask


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_padding_values_change_nothing(name):
    logprobs, old, advantages, mask = random_inputs(0)
    kwargs = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}
    loss, grad, metrics = loss_and_grad(name, logprobs, old, advantages, mask, **kwargs)
    masked = ~mask.bool()
    garbage = torch.full_like(logprobs, 37.0)
    if name == "clip_cov":
        kwargs = {"generator": torch.Generator().manual_seed(0)}
    loss_2, grad_2, metrics_2 = loss_and_grad(
        name,
        torch.where(masked, -garbage, logprobs),
        torch.where(masked, garbage, old),
        torch.where(masked, garbage, advantages),
        mask,
        **kwargs,
    )
    torch.testing.assert_close(loss_2, loss)
    torch.testing.assert_close(grad_2, grad)
    assert torch.all(grad[masked] == 0)
    for key in metrics:
        torch.testing.assert_close(metrics_2[key], metrics[key])


@pytest.mark.parametrize("name", ALL_LOSSES)
@pytest.mark.parametrize("log_ratio", [50.0, -50.0])
def test_extreme_log_ratios_stay_finite(name, log_ratio):
    logprobs, _, advantages, mask = random_inputs(1)
    old = logprobs - log_ratio
    loss, grad, metrics = loss_and_grad(name, logprobs, old, advantages, mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(value).all() for value in metrics.values())


def test_unknown_loss_lists_known_names():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*actor.policy_loss.*cispo"):
        loss_and_grad("ppo2", *random_inputs(0))


def test_misspelt_option_is_rejected():
    with pytest.raises(
        ValueError, match="no option clip_cov_ratoi.*options: clip_cov_lb, clip_cov_ratio"
    ):
        loss_and_grad("clip_cov", *random_inputs(0), clip_cov_ratoi=0.1)
    with pytest.raises(ValueError, match="'gpg' has no option tau_pos.*options: none"):
        loss_and_grad("gpg", *random_inputs(0), tau_pos=1.0)


def test_user_registered_loss_and_agg_override():
    @register_policy_loss("test_double_gpg", agg_mode="seq-mean-token-sum")
    def double_gpg(*, logprobs, advantages, **_):
        return -2 * advantages * logprobs, {}

    try:
        # one sequence, 2 tokens, A = 1, logp = (-1, -2): token sums 2 + 4 = 6, seq mean 6
        loss, _, metrics = loss_and_grad(
            "test_double_gpg", torch.tensor([[-1.0, -2.0]]), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
        )  # fmt: skip
        assert float(loss) == pytest.approx(6.0)
        assert "ppo_kl" in metrics
    finally:
        POLICY_LOSSES.unregister("test_double_gpg")
