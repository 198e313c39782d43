"""Entropy, DAPO helpers, group statistics, registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridflow.algos import (
    Registry,
    entropy_from_logits,
    group_stats,
    groups_with_signal,
    overlong_penalty,
)


def reference_entropy(logits):
    return torch.distributions.Categorical(logits=logits.float()).entropy()


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_chunked_entropy_matches_reference(chunk_size):
    logits = 5 * torch.randn(2, 9, 31, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        entropy_from_logits(logits, chunk_size=chunk_size), reference_entropy(logits)
    )


def test_entropy_hand_computed_and_extremes():
    # uniform over 4 -> log 4; one-hot-like (logit 1000) -> 0; bf16 input -> fp32 output
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]]).bfloat16()
    entropy = entropy_from_logits(logits)
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy, torch.tensor([math.log(4), 0.0]))


def test_chunked_entropy_gradient_matches_reference():
    base = torch.randn(4, 5, 11, generator=torch.Generator().manual_seed(1))
    chunked_logits = base.clone().requires_grad_()
    reference_logits = base.clone().requires_grad_()
    weights = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    (entropy_from_logits(chunked_logits, chunk_size=3) * weights).sum().backward()
    (reference_entropy(reference_logits) * weights).sum().backward()
    torch.testing.assert_close(chunked_logits.grad, reference_logits.grad)


def test_overlong_penalty_hand_computed():
    # L_max 100, buffer 20 -> ramp from 80: L=50 -> 0, 80 -> 0, 90 -> -(10/20) = -0.5,
    # 100 -> -1; factor 2 doubles it
    lengths = torch.tensor([50, 80, 90, 100])
    torch.testing.assert_close(
        overlong_penalty(lengths, 100, 20, 1.0), torch.tensor([0.0, 0.0, -0.5, -1.0])
    )
    torch.testing.assert_close(
        overlong_penalty(lengths, 100, 20, 2.0), torch.tensor([0.0, 0.0, -1.0, -2.0])
    )
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 100, 0)


@pytest.mark.parametrize("index_kind", ["strings", "int-tensor"])
def test_groups_with_signal(index_kind):
    # a: 1, 1 (no signal); b: 0, 1 (signal); c: 0.5, 0.5 (none); d: one sample (none)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 0.5, 2.0])
    groups = ["a", "b", "b", "c", "a", "c", "d"]
    index = np.array(groups) if index_kind == "strings" else torch.tensor([ord(g) for g in groups])
    keep = groups_with_signal(scores, index)
    assert keep.tolist() == [False, True, True, False, False, False, False]
    assert groups_with_signal(scores.numpy(), index).tolist() == keep.tolist()


def test_group_stats_with_unorderable_ids():
    # mixed id types cannot be sorted by np.unique: first-seen order is used instead
    index = np.array([("p", 1), 3, ("p", 1), 3, "x"], dtype=object)
    stats = group_stats(torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0]), index)
    assert stats.count.tolist() == [2, 2, 1]
    assert stats.mean.tolist() == [2.0, 4.0, 5.0]
    # unbiased std of (1, 3) = sqrt(2); of (2, 6) = sqrt(8); group of one: 0
    torch.testing.assert_close(
        stats.std, torch.tensor([math.sqrt(2), math.sqrt(8), 0.0], dtype=torch.float64)
    )


def test_registry_errors():
    registry = Registry("widget", config_key="a.b")
    registry.register("one")(lambda: 1)
    assert "one" in registry and len(registry) == 1
    with pytest.raises(ValueError, match=r"unknown widget 'two' \(config key a.b\); known: one"):
        registry.get("two")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("one")(lambda: 2)
    registry.register("one", override=True)(lambda: 3)
    assert registry.get("one").fn() == 3


def saved_bytes_for_backward(logits, chunk_size):
    """Bytes autograd keeps for the backward pass of the entropy (saved-tensor hooks)."""
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        entropy_from_logits(logits, chunk_size=chunk_size)
    return saved[0]


def test_chunked_entropy_keeps_no_softmax_for_backward():
    # Chunks are recomputed in the backward pass, so only the logits themselves are kept;
    # one big chunk keeps logsumexp + the full softmax (4x the logits here).
    logits = torch.randn(64, 500, requires_grad=True)
    logits_bytes = logits.numel() * logits.element_size()
    assert saved_bytes_for_backward(logits, chunk_size=8) <= 1.05 * logits_bytes
    assert saved_bytes_for_backward(logits, chunk_size=64) >= 2 * logits_bytes
