"""Advantage estimators: hand-computed cases, literal-loop references, invariances."""

from __future__ import annotations

import math
import uuid
import zlib

import numpy as np
import pytest
import torch

from hybridflow.algos import ADVANTAGE_ESTIMATORS, compute_advantage, register_advantage

GROUP_ESTIMATORS = ["grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg"]


def outcome_batch(scores, lengths, width):
    """Rewards with each score on the last valid token of a right-padded response."""
    batch = len(scores)
    rewards = torch.zeros(batch, width)
    mask = torch.zeros(batch, width)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        mask[i, :length] = 1
        rewards[i, length - 1] = score
    return rewards, mask


def per_sample(advantages, mask):
    """The constant per-sample value of an outcome advantage (checks it is constant)."""
    values = []
    for row, row_mask in zip(advantages, mask):
        valid = row[row_mask.bool()]
        assert torch.allclose(valid, valid[0].expand_as(valid), atol=1e-6)
        assert torch.all(row[~row_mask.bool()] == 0)
        values.append(float(valid[0]))
    return values


# ------------------------------------------------------------------- hand-computed cases


def test_grpo_hand_computed():
    # group a: scores 1, 0 -> mean 0.5, unbiased std sqrt(0.5) = 0.70711
    #   A = +-0.5 / (0.70711 + 1e-6) = +-0.70711
    # group b: scores 1, 1, 1 -> std 0 -> A = 0 (not NaN)
    # group c: one sample with score 2 -> mean 0, std 1 -> A = 2 / (1 + 1e-6)
    rewards, mask = outcome_batch([1, 0, 1, 1, 1, 2], [3, 2, 1, 3, 2, 3], 3)
    index = np.array(["a", "a", "b", "b", "b", "c"], dtype=object)
    advantages, returns = compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=index
    )
    expected = [
        0.5 / (math.sqrt(0.5) + 1e-6),
        -0.5 / (math.sqrt(0.5) + 1e-6),
        0,
        0,
        0,
        2 / (1 + 1e-6),
    ]
    assert per_sample(advantages, mask) == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(returns, advantages)


def test_dr_grpo_hand_computed():
    # no std: group a scores 3, 1, 2 -> mean 2 -> A = 1, -1, 0; singleton 5 -> A = 5
    rewards, mask = outcome_batch([3, 1, 2, 5], [2, 2, 2, 2], 2)
    advantages, _ = compute_advantage(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=torch.tensor([7, 7, 7, 9]),
        norm_adv_by_std_in_grpo=False,
    )
    assert per_sample(advantages, mask) == pytest.approx([1, -1, 0, 5])


def test_grpo_passk_hand_computed():
    # group a: scores 0.2, 0.9, 0.5 -> best is 0.9 (sample 1), runner-up 0.5 -> gap 0.4
    #   std of (0.2, 0.9, 0.5): mean 0.5333, dev -.3333 .3667 -.0333 -> var (0.1111+0.1344+0.0011)/2
    #   = 0.12333 -> std 0.35119 -> A_1 = 0.4 / 0.35119 = 1.13899
    # group b: scores 1, 1 -> gap 0, std 0 -> all zero
    rewards, mask = outcome_batch([0.2, 0.9, 0.5, 1.0, 1.0], [1, 2, 3, 3, 1], 3)
    index = np.array([0, 0, 0, 1, 1])
    advantages, _ = compute_advantage(
        "grpo_passk", token_level_rewards=rewards, response_mask=mask, index=index
    )
    std = float(np.std([0.2, 0.9, 0.5], ddof=1))
    assert per_sample(advantages, mask) == pytest.approx([0, 0.4 / (std + 1e-6), 0, 0, 0], abs=1e-6)
    assert 0.4 / std == pytest.approx(1.13899, abs=1e-4)
    unnormalised, _ = compute_advantage(
        "grpo_passk",
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        norm_adv_by_std_in_grpo=False,
    )
    assert per_sample(unnormalised, mask) == pytest.approx([0, 0.4, 0, 0, 0], abs=1e-6)


def test_grpo_passk_rejects_groups_of_one():
    rewards, mask = outcome_batch([1, 0, 1], [1, 1, 1], 1)
    with pytest.raises(ValueError, match="at least 2 samples"):
        compute_advantage(
            "grpo_passk", token_level_rewards=rewards, response_mask=mask, index=np.array([0, 0, 1])
        )


def test_rloo_hand_computed():
    # group of 3: scores 1, 0, 0 -> A_0 = 1 - mean(0, 0) = 1; A_1 = 0 - mean(1, 0) = -0.5
    #   (= 3/2 (s - 1/3): 3/2 * 2/3 = 1, 3/2 * -1/3 = -0.5)
    # group of one: A = s = 0.7
    rewards, mask = outcome_batch([1, 0, 0, 0.7], [2, 1, 2, 2], 2)
    advantages, _ = compute_advantage(
        "rloo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=np.array(["x", "x", "x", "y"]),
    )
    assert per_sample(advantages, mask) == pytest.approx([1, -0.5, -0.5, 0.7], abs=1e-6)


def test_reinforce_plus_plus_hand_computed():
    # gamma 0.5, one response of 3 valid tokens, rewards (1, 0, 2):
    #   G_2 = 2, G_1 = 0 + 0.5 * 2 = 1, G_0 = 1 + 0.5 * 1 = 1.5
    # second response: 1 valid token with reward 3 -> G = 3 (padding afterwards is 0)
    # whiten over the 4 valid returns (1.5, 1, 2, 3): mean 1.875, unbiased var
    #   (0.140625 + 0.765625 + 0.015625 + 1.265625) / 3 = 0.72917
    rewards = torch.tensor([[1.0, 0.0, 2.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    advantages, returns = compute_advantage(
        "reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=0.5
    )
    torch.testing.assert_close(returns, torch.tensor([[1.5, 1.0, 2.0], [3.0, 0, 0]]))
    std = math.sqrt(0.72917 + 1e-8)
    expected = torch.tensor([[1.5, 1.0, 2.0], [3.0, 1.875, 1.875]]) - 1.875
    expected = expected / std * mask
    torch.testing.assert_close(advantages, expected, atol=1e-4, rtol=0)


def test_reinforce_plus_plus_restarts_after_masked_token():
    # multi-turn: token 1 is a tool observation (mask 0); the return does not cross it.
    # gamma 1, rewards (0, x, 5, 1): G_3 = 1, G_2 = 5 + 1 = 6, G_1 = 0 (masked),
    # G_0 = 0 + 0 = 0 (the running return restarted at the masked token)
    rewards = torch.tensor([[0.0, 100.0, 5.0, 1.0]])
    mask = torch.tensor([[1.0, 0, 1, 1]])
    _, returns = compute_advantage(
        "reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask
    )
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.0, 6.0, 1.0]]))


def test_reinforce_plus_plus_baseline_hand_computed():
    # scores a: 2, 0 -> centred 1, -1; singleton b: 4 -> centred 4 (no baseline)
    # lengths 1, 2, 1 -> valid values (1, -1, -1, 4): mean 0.75, unbiased var
    #   (0.0625 + 3.0625 + 3.0625 + 10.5625) / 3 = 5.58333
    rewards, mask = outcome_batch([2, 0, 4], [1, 2, 1], 2)
    advantages, returns = compute_advantage(
        "reinforce_plus_plus_baseline",
        token_level_rewards=rewards,
        response_mask=mask,
        index=np.array(["a", "a", "b"]),
    )
    std = math.sqrt(5.583333 + 1e-8)
    expected = [(1 - 0.75) / std, (-1 - 0.75) / std, (4 - 0.75) / std]
    assert per_sample(advantages, mask) == pytest.approx(expected, abs=1e-5)
    torch.testing.assert_close(returns, advantages)


def test_remax_hand_computed():
    # rewards (0, 1, 2) valid, baseline 1.5: returns-to-go (3, 3, 2), A = (1.5, 1.5, 0.5)
    # second row: 2 valid tokens, reward 1 on the last, baseline 1 -> returns (1, 1), A = 0
    rewards = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    advantages, returns = compute_advantage(
        "remax",
        token_level_rewards=rewards,
        response_mask=mask,
        reward_baselines=torch.tensor([1.5, 1.0]),
    )
    torch.testing.assert_close(returns, torch.tensor([[3.0, 3.0, 2.0], [1.0, 1.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[1.5, 1.5, 0.5], [0.0, 0.0, 0.0]]))


def test_opo_hand_computed():
    # group: scores 1 (length 1), 0 (length 3) -> baseline (1*1 + 3*0) / 4 = 0.25
    #   A = 0.75, -0.25; singleton score 2 -> baseline 0 -> A = 2
    rewards, mask = outcome_batch([1, 0, 2], [1, 3, 2], 3)
    advantages, _ = compute_advantage(
        "opo", token_level_rewards=rewards, response_mask=mask, index=np.array([5, 5, 6])
    )
    assert per_sample(advantages, mask) == pytest.approx([0.75, -0.25, 2.0])


def test_gpg_hand_computed():
    # B = 4 samples, 2 non-zero scores -> alpha = 2
    # group a: 1, 0 -> mean 0.5 -> A = 2 * 0.5 = 1, 2 * -0.5 = -1
    # group b: 0, 3 -> mean 1.5 -> A = -3, 3
    rewards, mask = outcome_batch([1, 0, 0, 3], [1, 1, 2, 2], 2)
    advantages, _ = compute_advantage(
        "gpg", token_level_rewards=rewards, response_mask=mask, index=np.array(["a", "a", "b", "b"])
    )
    assert per_sample(advantages, mask) == pytest.approx([1, -1, -3, 3])


def test_gae_hand_computed():
    # gamma 0.9, lam 0.5, rewards (0, 0, 1), values (0.5, 0.6, 0.8)
    #   delta_2 = 1 + 0.9*0 - 0.8 = 0.2            A_2 = 0.2
    #   delta_1 = 0 + 0.9*0.8 - 0.6 = 0.12         A_1 = 0.12 + 0.45*0.2 = 0.21
    #   delta_0 = 0 + 0.9*0.6 - 0.5 = 0.04         A_0 = 0.04 + 0.45*0.21 = 0.1345
    # returns = A + V = (0.6345, 0.81, 1.0)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.8]])
    mask = torch.ones(1, 3)
    advantages, returns = compute_advantage(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.5
    )
    torch.testing.assert_close(returns, torch.tensor([[0.6345, 0.81, 1.0]]))
    raw = torch.tensor([0.1345, 0.21, 0.2])
    torch.testing.assert_close(advantages[0], (raw - raw.mean()) / raw.std(), atol=1e-4, rtol=0)


def test_gae_skips_masked_tokens_inside_a_response():
    # token 1 is a tool observation (mask 0). With it skipped, the valid tokens (0, 2, 3)
    # must give the same raw advantages/returns as the 3-token response without it.
    values = torch.tensor([[0.5, 123.0, 0.6, 0.8]])
    rewards = torch.tensor([[0.0, -50.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0, 1, 1]])
    _, returns = compute_advantage(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.5
    )
    torch.testing.assert_close(returns, torch.tensor([[0.6345, 0.0, 0.81, 1.0]]))


# ------------------------------------------------------- literal-loop reference implementations


def reference_group_advantages(name, scores, lengths, groups, norm_by_std=True, eps=1e-6):
    """Per-sample loop over the formulas of docs/algorithms.md."""
    members: dict = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    batch = len(scores)
    nonzero = sum(1 for s in scores if s != 0)
    result = []
    for i in range(batch):
        mine = members[groups[i]]
        group_scores = [scores[j] for j in mine]
        n = len(mine)
        mean = sum(group_scores) / n
        std = math.sqrt(sum((s - mean) ** 2 for s in group_scores) / (n - 1)) if n > 1 else 1.0
        if n == 1:
            mean = 0.0
        if name == "grpo":
            a = scores[i] - mean
            result.append(a / (std + eps) if norm_by_std else a)
        elif name == "rloo":
            if n == 1:
                result.append(scores[i])
            else:
                others = [scores[j] for j in mine if j != i]
                result.append(scores[i] - sum(others) / len(others))
        elif name == "reinforce_plus_plus_baseline":
            result.append(scores[i] - mean)  # whitened over the batch below
        elif name == "opo":
            if n == 1:
                result.append(scores[i])
            else:
                total_len = sum(lengths[j] for j in mine)
                baseline = sum(lengths[j] * scores[j] for j in mine) / total_len
                result.append(scores[i] - baseline)
        elif name == "gpg":
            result.append(batch / max(1, nonzero) * (scores[i] - mean))
    if name == "reinforce_plus_plus_baseline":
        flat = [result[i] for i in range(batch) for _ in range(lengths[i])]
        mu = sum(flat) / len(flat)
        var = sum((x - mu) ** 2 for x in flat) / (len(flat) - 1)
        result = [(x - mu) / math.sqrt(var + 1e-8) for x in result]
    return result


def random_groups(rng, num_groups):
    sizes = rng.integers(1, 6, size=num_groups)
    sizes[0] = 1  # always at least one group of one
    ids = [str(uuid.UUID(int=int(rng.integers(0, 2**62)))) for _ in range(num_groups)]
    groups = [ids[g] for g, size in enumerate(sizes) for _ in range(size)]
    order = rng.permutation(len(groups))  # groups interleaved, not contiguous
    return [groups[k] for k in order]


@pytest.mark.parametrize(
    ("name", "norm_by_std"), [(name, True) for name in GROUP_ESTIMATORS] + [("grpo", False)]
)
@pytest.mark.parametrize("index_kind", ["uuid-strings", "int-tensor"])
def test_group_estimators_match_literal_loop(name, index_kind, norm_by_std):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{index_kind}".encode()))
    groups = random_groups(rng, num_groups=9)
    batch, width = len(groups), 6
    # Discrete scores so that ties and all-equal groups occur.
    scores = rng.choice([0.0, 0.5, 1.0, 2.0], size=batch).tolist()
    lengths = rng.integers(1, width + 1, size=batch).tolist()
    rewards, mask = outcome_batch(scores, lengths, width)
    if index_kind == "int-tensor":
        _, dense = np.unique(np.array(groups), return_inverse=True)
        index = torch.as_tensor(dense * 11 + 3)  # sparse integer ids
    else:
        index = np.array(groups, dtype=object)
    advantages, _ = compute_advantage(
        name,
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        norm_adv_by_std_in_grpo=norm_by_std,
    )
    expected = reference_group_advantages(name, scores, lengths, groups, norm_by_std)
    assert per_sample(advantages, mask) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("index_kind", ["uuid-strings", "int-tensor"])
def test_grpo_passk_matches_literal_loop(index_kind):
    rng = np.random.default_rng(3)
    groups = [g for g in range(7) for _ in range(rng.integers(2, 6))]
    groups = [groups[k] for k in rng.permutation(len(groups))]
    scores = rng.choice([0.0, 0.25, 1.0, 3.0], size=len(groups)).tolist()
    rewards, mask = outcome_batch(scores, [2] * len(groups), 2)
    index = (
        torch.tensor(groups) if index_kind == "int-tensor" else np.array([f"g{g}" for g in groups])
    )
    advantages, _ = compute_advantage(
        "grpo_passk", token_level_rewards=rewards, response_mask=mask, index=index
    )
    expected = []
    for i, group in enumerate(groups):
        mine = [j for j, other in enumerate(groups) if other == group]
        ranked = sorted(mine, key=lambda j: (-scores[j], j))
        if i != ranked[0]:
            expected.append(0.0)
            continue
        group_scores = [scores[j] for j in mine]
        std = float(np.std(group_scores, ddof=1))
        expected.append((scores[ranked[0]] - scores[ranked[1]]) / (std + 1e-6))
    assert per_sample(advantages, mask) == pytest.approx(expected, abs=1e-5)


def test_gae_matches_literal_loop_with_gaps():
    rng = np.random.default_rng(0)
    batch, width, gamma, lam = 5, 7, 0.95, 0.8
    mask = torch.as_tensor(rng.random((batch, width)) > 0.3, dtype=torch.float32)
    mask[:, 0] = 1
    rewards = torch.as_tensor(rng.normal(size=(batch, width)), dtype=torch.float32)
    values = torch.as_tensor(rng.normal(size=(batch, width)), dtype=torch.float32)
    advantages, returns = compute_advantage(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=gamma, lam=lam
    )
    raw = torch.zeros(batch, width)
    for i in range(batch):
        valid_positions = [t for t in range(width) if mask[i, t] > 0]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(valid_positions):
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            next_adv = delta + gamma * lam * next_adv
            next_value = float(values[i, t])
            raw[i, t] = next_adv
    torch.testing.assert_close(returns, (raw + values) * mask, atol=1e-5, rtol=1e-5)
    valid = raw[mask.bool()]
    whitened = (raw - valid.mean()) / valid.std() * mask
    torch.testing.assert_close(advantages, whitened, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------ invariances

ALL_ESTIMATORS = [
    "gae", "grpo", "grpo_passk", "rloo", "reinforce_plus_plus",
    "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
]  # fmt: skip


def estimator_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    batch, width = 8, 6
    mask = (torch.rand(batch, width, generator=generator) > 0.25).float()
    mask[:, 0] = 1
    rewards = torch.randn(batch, width, generator=generator)
    return dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=np.array(["p", "p", "q", "q", "q", "r", "r", "s"]),
        values=torch.randn(batch, width, generator=generator),
        reward_baselines=torch.randn(batch, generator=generator),
        gamma=0.9,
        lam=0.7,
    )


@pytest.mark.parametrize("name", ALL_ESTIMATORS)
def test_padding_values_change_no_output(name):
    inputs = estimator_inputs(1)
    if name == "grpo_passk":
        inputs["index"] = np.array(["p", "p", "q", "q", "q", "r", "r", "r"])
    advantages, returns = compute_advantage(name, **inputs)
    masked = ~inputs["response_mask"].bool()
    garbage = dict(inputs)
    garbage["token_level_rewards"] = inputs["token_level_rewards"].masked_fill(masked, 1e4)
    garbage["values"] = inputs["values"].masked_fill(masked, float("nan"))
    advantages_2, returns_2 = compute_advantage(name, **garbage)
    torch.testing.assert_close(advantages_2, advantages)
    torch.testing.assert_close(returns_2, returns)
    assert torch.all(advantages[masked] == 0) and torch.all(returns[masked] == 0)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS + ["grpo_passk"])
def test_all_equal_group_gives_zero_advantage(name):
    # two groups of 4, every sample of group "same" scores 0.1 (inexact in binary)
    scores = [0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 1.0]
    rewards, mask = outcome_batch(scores, [3, 1, 2, 3, 1, 2, 3, 3], 3)
    index = np.array(["same"] * 4 + ["mixed"] * 4)
    advantages, _ = compute_advantage(
        name, token_level_rewards=rewards, response_mask=mask, index=index
    )
    assert torch.isfinite(advantages).all()
    if name == "reinforce_plus_plus_baseline":
        # whitening shifts by the batch mean: equal scores -> equal advantages
        values = per_sample(advantages, mask)[:4]
        assert values == pytest.approx([values[0]] * 4, abs=1e-6)
    else:
        assert torch.all(advantages[:4].abs() < 1e-6)


def test_advantages_are_detached_and_keep_dtype():
    inputs = estimator_inputs(2)
    inputs["values"] = inputs["values"].requires_grad_()
    advantages, returns = compute_advantage("gae", **inputs)
    assert not advantages.requires_grad and not returns.requires_grad
    bf16 = dict(inputs, token_level_rewards=inputs["token_level_rewards"].bfloat16())
    assert compute_advantage("grpo", **bf16)[0].dtype == torch.bfloat16


# ------------------------------------------------------------------------- errors / registry


def test_unknown_estimator_lists_known_names():
    inputs = estimator_inputs(0)
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpoo'.*gae.*grpo.*rloo"):
        compute_advantage("grpoo", **inputs)


@pytest.mark.parametrize(
    ("name", "missing"), [("grpo", "index"), ("gae", "values"), ("remax", "reward_baselines")]
)
def test_missing_input_is_a_clear_error(name, missing):
    inputs = estimator_inputs(0)
    inputs[missing] = None
    with pytest.raises(ValueError, match=missing):
        compute_advantage(name, **inputs)


def test_index_with_wrong_length_is_rejected():
    inputs = estimator_inputs(0)
    inputs["index"] = np.array(["a", "b"])
    with pytest.raises(ValueError, match="index must have shape"):
        compute_advantage("grpo", **inputs)


def test_user_registered_estimator_is_used():
    @register_advantage("test_sign_of_score")
    def sign_of_score(*, token_level_rewards, response_mask, **_):
        sign = torch.sign(token_level_rewards.sum(-1, keepdim=True)) * response_mask
        return sign, sign

    try:
        rewards, mask = outcome_batch([2.0, -3.0], [1, 2], 2)
        advantages, _ = compute_advantage(
            "test_sign_of_score", token_level_rewards=rewards, response_mask=mask
        )
        torch.testing.assert_close(advantages, torch.tensor([[1.0, 0.0], [-1.0, -1.0]]))
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("test_sign_of_score")(sign_of_score)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_sign_of_score")
