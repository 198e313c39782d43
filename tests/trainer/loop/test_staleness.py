"""Staleness of async batches (trainer/loop/staleness.py), on hand-made token versions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.trainer.loop.staleness import (
    concat_rollouts,
    drop_stale_groups,
    first_groups,
    importance_ratio_max,
    oldest_versions,
    staleness_metrics,
)

# 3 samples, 4 response slots; -1 after each one's end
TOKEN_VERSIONS = torch.tensor([[3, 3, 4, 4], [4, 4, 4, -1], [2, 3, -1, -1]])
RESPONSE_MASK = (TOKEN_VERSIONS >= 0).float()


def test_a_sample_is_as_stale_as_its_oldest_token():
    assert oldest_versions(TOKEN_VERSIONS, RESPONSE_MASK).tolist() == [3, 4, 2]
    metrics = staleness_metrics(TOKEN_VERSIONS, RESPONSE_MASK, trained_version=4)
    # sample lags 1, 0, 2: mean 1, max 2; token lags 1 1 0 0 | 0 0 0 | 2 1 over 9 tokens
    assert metrics["async/staleness_mean"] == 1 and metrics["async/staleness_max"] == 2
    assert metrics["async/token_lag_0"] == pytest.approx(5 / 9)
    assert metrics["async/token_lag_1"] == pytest.approx(3 / 9)
    assert metrics["async/token_lag_2+"] == pytest.approx(1 / 9)


def _rollout(uids, versions, prompt_width=2):
    versions = torch.as_tensor(versions)
    rows = len(uids)
    return Batch(
        {
            "prompts": torch.arange(rows * prompt_width).reshape(rows, prompt_width) + 10,
            "prompt_mask": torch.ones(rows, prompt_width, dtype=torch.long),
            "attention_mask": torch.ones(rows, prompt_width + versions.shape[1], dtype=torch.long),
            "token_versions": versions,
            "response_mask": torch.ones(versions.shape),
        },
        {"uid": np.asarray(uids, dtype=object)},
    )


def test_drop_takes_whole_groups_with_a_token_older_than_allowed():
    # group a: one sample began at version 1; group b: both at version 2
    batch = _rollout(["a", "a", "b", "b"], [[2, 2], [1, 2], [2, 3], [2, 2]])
    kept, dropped = drop_stale_groups(batch, min_version=2)
    assert dropped == 1 and list(kept.arrays["uid"]) == ["b", "b"]
    kept, dropped = drop_stale_groups(batch, min_version=1)
    assert dropped == 0 and len(kept) == 4


def test_replacement_groups_join_a_batch_with_wider_prompts():
    fresh = _rollout(["c", "c", "d", "d"], [[3, 3]] * 4, prompt_width=1)
    kept = _rollout(["b", "b"], [[2, 2]] * 2, prompt_width=2)
    joined = concat_rollouts([kept, first_groups(fresh, 1)], pad_token_id=0)
    assert list(joined.arrays["uid"]) == ["b", "b", "c", "c"]
    assert joined.tensors["prompts"][2].tolist() == [0, 10]  # left-padded to width 2
    assert joined.tensors["prompt_mask"][2].tolist() == [0, 1]
    assert joined.tensors["attention_mask"][2].tolist() == [0, 1, 1, 1]


def test_replacement_groups_with_images_keep_their_mrope_rows_aligned():
    """Prompts with images carry mrope_positions [B, 3, P+R] beside attention_mask: a
    narrower replacement group's rows are left-padded with it (0 on padding)."""
    from hybridflow.data.image_batch import MROPE_POSITIONS

    fresh = _rollout(["c", "c"], [[3, 3]] * 2, prompt_width=1)
    kept = _rollout(["b", "b"], [[2, 2]] * 2, prompt_width=2)
    fresh.tensors[MROPE_POSITIONS] = torch.tensor([[0, 5, 6]] * 3).expand(2, 3, 3)
    kept.tensors[MROPE_POSITIONS] = torch.tensor([[0, 1, 2, 3]] * 3).expand(2, 3, 4)
    joined = concat_rollouts([kept, fresh], pad_token_id=0)
    assert joined.tensors[MROPE_POSITIONS].shape == (4, 3, 4)
    assert joined.tensors[MROPE_POSITIONS][2].tolist() == [[0, 0, 5, 6]] * 3


def test_importance_ratio_max_is_taken_before_the_cap():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.0 - math.log(3), -2.0, 0.0]])  # ratios 3, 1, e^-0.5
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    assert importance_ratio_max(old, rollout, mask) == pytest.approx(3.0)
    assert importance_ratio_max(old, rollout, torch.tensor([[0.0, 1.0, 1.0]])) == pytest.approx(1)
