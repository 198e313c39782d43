"""The algos run unchanged on CUDA tensors and agree with CPU (needs a CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algos import (
    AdaptiveKLController,
    agg_loss,
    apply_kl_in_reward,
    compute_advantage,
    entropy_from_logits,
    groups_with_signal,
    kl_penalty,
    overlong_penalty,
    policy_loss,
    rollout_is_weights,
    value_loss,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ESTIMATORS = [
    "gae", "grpo", "grpo_passk", "rloo", "reinforce_plus_plus",
    "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
]  # fmt: skip
LOSSES = ["vanilla", "gspo", "cispo", "sapo", "gpg", "kl_cov", "geo_mean"]


def batch(device):
    generator = torch.Generator().manual_seed(0)
    size, width = 12, 16
    mask = (torch.rand(size, width, generator=generator) > 0.2).float()
    mask[:, 0] = 1
    tensors = dict(
        rewards=torch.randn(size, width, generator=generator),
        values=torch.randn(size, width, generator=generator),
        baselines=torch.randn(size, generator=generator),
        old=-torch.rand(size, width, generator=generator) * 3,
        noise=0.3 * torch.randn(size, width, generator=generator),
        logits=torch.randn(size, width, 50, generator=generator),
        mask=mask,
    )
    return {name: value.to(device) for name, value in tensors.items()}


@pytest.mark.parametrize("index_kind", ["strings", "cuda-int"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimators_match_cpu(name, index_kind):
    groups = np.repeat(np.arange(4), 3)
    results = []
    for device in ("cpu", "cuda"):
        data = batch(device)
        index = np.array([f"u{g}" for g in groups]) if index_kind == "strings" else torch.as_tensor(groups, device=device)  # fmt: skip
        advantages, returns = compute_advantage(
            name, token_level_rewards=data["rewards"], response_mask=data["mask"], index=index,
            values=data["values"], reward_baselines=data["baselines"], gamma=0.9, lam=0.8,
        )  # fmt: skip
        assert advantages.device.type == device and returns.device.type == device
        results.append((advantages.cpu(), returns.cpu()))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", LOSSES)
def test_losses_match_cpu(name):
    options = {"kl_cov_ratio": 0.05} if name == "kl_cov" else {}
    results = []
    for device in ("cpu", "cuda"):
        data = batch(device)
        logprobs = (data["old"] + data["noise"]).requires_grad_()
        advantages = data["rewards"][:, :1].expand_as(logprobs)
        weights, _ = rollout_is_weights(data["old"], data["old"] - data["noise"], data["mask"], 2.0)
        loss, metrics = policy_loss(
            name, old_logprobs=data["old"], logprobs=logprobs, advantages=advantages,
            response_mask=data["mask"], rollout_is_weights=weights,
            global_token_count=data["mask"].sum(), **options,
        )  # fmt: skip
        loss.backward()
        results.append((loss.detach().cpu(), logprobs.grad.cpu(), metrics["ppo_kl"].cpu()))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def test_clip_cov_runs_on_cuda_with_a_cuda_generator():
    data = batch("cuda")
    logprobs = (data["old"] + data["noise"]).requires_grad_()
    loss, _ = policy_loss(
        "clip_cov", old_logprobs=data["old"], logprobs=logprobs,
        advantages=data["rewards"], response_mask=data["mask"], clip_cov_ratio=0.1,
        generator=torch.Generator(device="cuda").manual_seed(0),
    )  # fmt: skip
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()


def test_everything_else_matches_cpu():
    results = []
    for device in ("cpu", "cuda"):
        data = batch(device)
        values = data["values"].clone().requires_grad_()
        vloss, _ = value_loss(
            values, data["values"] + data["noise"], data["rewards"], data["mask"], 0.5
        )
        vloss.backward()
        controller = AdaptiveKLController(0.1, 0.05, 100)
        rewards, _ = apply_kl_in_reward(data["rewards"], data["old"], data["old"] + data["noise"], data["mask"], controller, "k3")  # fmt: skip
        logits = data["logits"].clone().requires_grad_()
        entropy = entropy_from_logits(logits, chunk_size=7)
        agg_loss(entropy, data["mask"], "seq-mean-token-mean").backward()
        results.append(
            (
                values.grad.cpu(),
                rewards.cpu(),
                controller.value,
                entropy.detach().cpu(),
                logits.grad.cpu(),
                kl_penalty(data["old"], data["old"] + data["noise"], "k3+").cpu(),
                overlong_penalty(data["mask"].sum(-1), 16, 4).cpu(),
                groups_with_signal(
                    data["rewards"].sum(-1), torch.arange(12, device=device) // 3
                ).cpu(),
            )
        )
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)
