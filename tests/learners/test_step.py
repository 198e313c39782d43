"""Mini-batch plans: a sequence-parallel group takes the mini-batches data parallelism takes."""

import torch

from hybridflow.learners.step import mini_batch_plan


def _permutation(n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(n))


def test_shards_give_the_data_parallel_mini_batches():
    # Two shards of 6 rows (what two data-parallel ranks would hold), mini-batches of 4 rows:
    # data parallelism takes 2 rows of each shard per step, in the order each rank walks.
    order = _permutation(6)
    plan = mini_batch_plan(12, 4, 2, _permutation)
    data_parallel = [
        sorted([*order[2 * m : 2 * m + 2].tolist(), *(order[2 * m : 2 * m + 2] + 6).tolist()])
        for m in range(3)
    ]
    assert [sorted(rows.tolist()) for rows in plan] == data_parallel


def test_one_shard_or_an_uneven_split_cuts_the_whole_batch():
    order = _permutation(12)
    for shards in (1, 3):  # 3 shards cannot give a 4-row mini-batch evenly
        plan = mini_batch_plan(12, 4, shards, _permutation)
        assert [rows.tolist() for rows in plan] == [order[i : i + 4].tolist() for i in (0, 4, 8)]
    assert [r.tolist() for r in mini_batch_plan(4, 2, 2, torch.arange)] == [[0, 2], [1, 3]]
