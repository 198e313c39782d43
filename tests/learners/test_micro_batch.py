import itertools
import random

import pytest

from hybridflow.learners.micro_batch import (
    balanced_dp_order,
    karmarkar_karp,
    pack_by_token_budget,
    split_fixed,
)


def _sums(lengths, parts):
    return [sum(lengths[i] for i in p) for p in parts]


def _is_partition(parts, n):
    flat = sorted(i for p in parts for i in p)
    return flat == list(range(n))


def test_split_fixed_covers_in_order():
    assert split_fixed(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        split_fixed(3, 0)


def test_karmarkar_karp_known_example():
    # Karmarkar-Karp's own example {4, 5, 6, 7, 8}: differencing 8-7 -> 1, 6-5 -> 1, then
    # 4-1 -> 3, 3-1 -> 2: sums 16 and 14 (the optimum 15/15 exists: KK is a heuristic).
    lengths = [4, 5, 6, 7, 8]
    parts = karmarkar_karp(lengths, 2)
    assert _is_partition(parts, 5)
    assert sorted(_sums(lengths, parts)) == [14, 16]


def test_karmarkar_karp_near_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.randint(1, 100) for _ in range(8)]
        parts = karmarkar_karp(lengths, 2)
        assert _is_partition(parts, 8)
        spread = abs(_sums(lengths, parts)[0] - _sums(lengths, parts)[1])
        best = min(
            abs(2 * sum(c) - sum(lengths))
            for r in range(9)
            for c in itertools.combinations(lengths, r)
        )
        # KK is a heuristic: within the largest item of optimal, and usually optimal.
        assert spread <= best + max(lengths)
    # And much better than the naive contiguous split on sorted data.
    lengths = list(range(1, 65))
    parts = karmarkar_karp(lengths, 4)
    sums = _sums(lengths, parts)
    assert max(sums) - min(sums) <= 2


def test_karmarkar_karp_equal_size():
    rng = random.Random(1)
    lengths = [rng.randint(10, 500) for _ in range(24)]
    parts = karmarkar_karp(lengths, 4, equal_size=True)
    assert _is_partition(parts, 24)
    assert [len(p) for p in parts] == [6, 6, 6, 6]
    sums = _sums(lengths, parts)
    assert max(sums) - min(sums) <= max(lengths) // 2
    with pytest.raises(ValueError):
        karmarkar_karp(lengths[:23], 4, equal_size=True)


def test_pack_by_token_budget_respects_budget_and_is_tight():
    rng = random.Random(2)
    lengths = [rng.randint(5, 60) for _ in range(40)]
    budget = 128
    groups = pack_by_token_budget(lengths, budget)
    assert _is_partition(groups, 40)
    assert all(s <= budget for s in _sums(lengths, groups))
    lower_bound = -(-sum(lengths) // budget)
    assert len(groups) <= lower_bound + 2


def test_pack_by_token_budget_forced_count_and_errors():
    lengths = [10, 20, 30]
    groups = pack_by_token_budget(lengths, 100, num_micro_batches=5)
    assert len(groups) == 5
    assert _is_partition(groups, 3)
    assert sum(1 for g in groups if not g) == 2  # 3 samples cannot fill 5 micro-batches
    groups = pack_by_token_budget([50, 50, 50, 50], 100, num_micro_batches=3)
    assert len(groups) == 3 and all(s <= 100 for s in _sums([50] * 4, groups))
    with pytest.raises(ValueError, match="token budget"):
        pack_by_token_budget([10, 200], 100)
    with pytest.raises(ValueError, match="at least"):
        pack_by_token_budget([60, 60, 60], 100, num_micro_batches=2)


def test_balanced_dp_order_is_a_balanced_permutation():
    rng = random.Random(3)
    lengths = [rng.choice([8, 16, 512, 1024]) for _ in range(32)]
    order = balanced_dp_order(lengths, 4)
    assert sorted(order) == list(range(32))
    chunks = [order[r * 8 : (r + 1) * 8] for r in range(4)]
    sums = _sums(lengths, chunks)
    naive = _sums(lengths, [list(range(r * 8, (r + 1) * 8)) for r in range(4)])
    assert max(sums) - min(sums) <= max(naive) - min(naive)
    assert max(sums) - min(sums) <= 1024
    assert balanced_dp_order(lengths, 1) == list(range(32))


def test_balance_for_data_parallel_reorders_a_batch():
    import torch

    from hybridflow.learners import balance_for_data_parallel
    from hybridflow.protocol import Batch

    lengths = torch.tensor([90, 80, 70, 60, 10, 20, 30, 40])  # contiguous halves: 300 vs 100
    mask = (torch.arange(100)[None] < lengths[:, None]).long()
    balanced = balance_for_data_parallel(Batch({"attention_mask": mask, "id": torch.arange(8)}), 2)
    halves = balanced["attention_mask"].sum(-1).view(2, 4).sum(-1).tolist()
    assert sum(halves) == 400 and abs(halves[0] - halves[1]) <= 20
    assert sorted(balanced["id"].tolist()) == list(range(8))
