"""Loss aggregation: hand-computed modes and micro-batch / data-parallel invariance."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algos import LOSS_AGG_MODES, agg_loss, policy_loss, value_loss

# Row 2 has no valid token: it must count for nothing in every mode.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 sequences
        ("seq-mean-token-mean", 2.75),  # (3/2 + 4/1) / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # (3/3 + 4/3) / 2, T = 3 columns
    ],
)
def test_modes_hand_computed(mode, expected):
    assert float(agg_loss(LOSS, MASK, mode)) == pytest.approx(expected)


def test_norm_length_and_global_counts_are_used():
    # (3/4 + 4/4) / 2 = 0.875
    assert float(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=4)) == pytest.approx(
        0.875
    )
    # 7 / 14 tokens in the whole mini-batch
    assert float(agg_loss(LOSS, MASK, "token-mean", global_token_count=14)) == pytest.approx(0.5)
    # (3 + 4) / 10 sequences in the whole mini-batch
    assert float(agg_loss(LOSS, MASK, "seq-mean-token-sum", global_seq_count=10)) == pytest.approx(
        0.7
    )
    # a tensor count works too (e.g. after an all_reduce)
    count = torch.tensor(14)
    assert float(agg_loss(LOSS, MASK, "token-mean", global_token_count=count)) == pytest.approx(0.5)


def test_empty_mask_gives_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        assert float(agg_loss(LOSS, torch.zeros_like(MASK), mode)) == 0.0


def test_unknown_mode_lists_known():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'.*seq-mean-token-mean"):
        agg_loss(LOSS, MASK, "mean")


# ------------------------------------------------------------------ sharding invariance


def sharded_batch(seed=0, batch=8, width=9):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 1, 4, 0, 7, 2, 9, 5])[:batch]  # row 3 has no valid token
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    mask[0, 3] = 0  # a masked token inside a response (tool output)
    return generator, mask


def shards(batch, ranks=2, micro_batches=2):
    """Row slices of the mini-batch: ranks x micro-batches of unequal token counts."""
    rows = torch.arange(batch).chunk(ranks * micro_batches)
    return [rows[r * micro_batches : (r + 1) * micro_batches] for r in range(ranks)]


def trimmed(tensor, mask, rows):
    """A micro-batch padded only to its own longest response (as dynamic batching does)."""
    width = max(int(mask[rows].nonzero()[:, 1].max()) + 1, 1) if mask[rows].any() else 1
    return tensor[rows, :width]


def accumulate(compute, mask, named_tensors, grad_name):
    """Sum of micro-batch losses over simulated ranks; the gradient of ``grad_name``
    is summed ("all-reduce sum") back into the full-batch layout.
    """
    total_loss = 0.0
    grad = torch.zeros_like(named_tensors[grad_name])
    for rank_rows in shards(mask.shape[0]):
        for rows in rank_rows:
            inputs = {name: trimmed(value, mask, rows) for name, value in named_tensors.items()}
            leaf = inputs[grad_name].clone().requires_grad_()
            inputs[grad_name] = leaf
            loss = compute(mask=trimmed(mask, mask, rows), **inputs)
            loss.backward()
            total_loss += loss.item()
            grad[rows, : leaf.shape[1]] += leaf.grad
    return total_loss, grad


def full_batch(compute, mask, named_tensors, grad_name):
    inputs = dict(named_tensors)
    leaf = inputs[grad_name].clone().requires_grad_()
    inputs[grad_name] = leaf
    loss = compute(mask=mask, **inputs)
    loss.backward()
    return loss.item(), leaf.grad


def global_counts(mask):
    return dict(
        global_token_count=mask.sum(),
        global_seq_count=(mask.sum(-1) > 0).sum(),
        norm_length=mask.shape[1],
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_micro_batches_and_ranks_equal_full_batch(mode):
    generator, mask = sharded_batch()
    theta = torch.randn(mask.shape, generator=generator)
    counts = global_counts(mask)

    def compute(mask, theta, **counts_override):
        return agg_loss(torch.sin(theta) * theta, mask, mode, **(counts_override or counts))

    full_loss, full_grad = full_batch(
        lambda mask, theta: agg_loss(torch.sin(theta) * theta, mask, mode),
        mask,
        {"theta": theta},
        "theta",
    )
    sharded_loss, sharded_grad = accumulate(compute, mask, {"theta": theta}, "theta")
    assert sharded_loss == pytest.approx(full_loss, rel=1e-5)
    torch.testing.assert_close(sharded_grad, full_grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_local_means_are_not_invariant(mode):
    # The negative control: averaging local means over micro-batches is *not* the
    # full-batch gradient (unequal token / sequence counts per micro-batch), so the test
    # above would fail without the global counts.
    generator, mask = sharded_batch()
    theta = torch.randn(mask.shape, generator=generator)
    num_micro = sum(len(rank) for rank in shards(mask.shape[0]))
    _, full_grad = full_batch(
        lambda mask, theta: agg_loss(theta * theta, mask, mode), mask, {"theta": theta}, "theta"
    )
    _, local_grad = accumulate(
        lambda mask, theta: agg_loss(theta * theta, mask, mode) / num_micro,
        mask,
        {"theta": theta},
        "theta",
    )
    assert not torch.allclose(local_grad, full_grad, atol=1e-4)


DETERMINISTIC_LOSSES = ["vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean"]


@pytest.mark.parametrize("name", DETERMINISTIC_LOSSES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_sharding_invariance(name, mode):
    # Clip-Cov / KL-Cov are left out on purpose: they choose tokens by batch statistics
    # (covariance means, top-k fraction), which depend on the shard by definition.
    generator, mask = sharded_batch(seed=1)
    old = -torch.rand(mask.shape, generator=generator) * 2
    logprobs = old + 0.3 * torch.randn(mask.shape, generator=generator)
    advantages = torch.randn(mask.shape[0], 1, generator=generator).expand_as(mask).contiguous()

    def make(counts):
        def compute(mask, logprobs, old, advantages):
            loss, _ = policy_loss(
                name, old_logprobs=old, logprobs=logprobs, advantages=advantages,
                response_mask=mask, loss_agg_mode=mode, clip_ratio_high=0.28, **counts,
            )  # fmt: skip
            return loss

        return compute

    tensors = {"logprobs": logprobs, "old": old, "advantages": advantages}
    full_loss, full_grad = full_batch(make({}), mask, tensors, "logprobs")
    sharded_loss, sharded_grad = accumulate(make(global_counts(mask)), mask, tensors, "logprobs")
    assert sharded_loss == pytest.approx(full_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(sharded_grad, full_grad)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_sharding_invariance(mode):
    generator, mask = sharded_batch(seed=2)
    old_values = torch.randn(mask.shape, generator=generator)
    values = old_values + torch.randn(mask.shape, generator=generator)
    returns = torch.randn(mask.shape, generator=generator)

    def make(counts):
        def compute(mask, values, old_values, returns):
            return value_loss(values, old_values, returns, mask, 0.5, mode, **counts)[0]

        return compute

    tensors = {"values": values, "old_values": old_values, "returns": returns}
    full_loss, full_grad = full_batch(make({}), mask, tensors, "values")
    sharded_loss, sharded_grad = accumulate(make(global_counts(mask)), mask, tensors, "values")
    assert sharded_loss == pytest.approx(full_loss, rel=1e-5)
    torch.testing.assert_close(sharded_grad, full_grad)


def test_value_loss_hand_computed():
    # c = 0.5, old 0:
    #   v=2, R=0: unclipped 4, clipped v^ = 0.5 -> 0.25 -> max 4, gradient 2 (v - R) = 4
    #   v=2, R=3: unclipped 1, clipped (0.5 - 3)^2 = 6.25 -> max 6.25 (clipped, no gradient)
    # 0.5 * token-mean = 0.5 * (4 + 6.25) / 2 = 2.5625
    values = torch.tensor([[2.0, 2.0]], requires_grad=True)
    loss, metrics = value_loss(
        values, torch.zeros(1, 2), torch.tensor([[0.0, 3.0]]), torch.ones(1, 2), 0.5
    )
    loss.backward()
    assert loss.item() == pytest.approx(2.5625)
    torch.testing.assert_close(values.grad, torch.tensor([[0.5 * 4 / 2, 0.0]]))
    assert float(metrics["vf_clipfrac"]) == pytest.approx(0.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_garbage_in_padding_changes_nothing(mode):
    garbage = torch.where(MASK, LOSS, torch.tensor(float("nan")))
    assert float(agg_loss(garbage, MASK, mode)) == pytest.approx(float(agg_loss(LOSS, MASK, mode)))
