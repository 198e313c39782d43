"""Rows shared by the ranks that split one model.

The controller splits a batch over every rank of a role (``Dispatch.DP_SPLIT``), whatever its
layout. Ranks that split one model over its sequence (Ulysses) must work on the same rows, so
each such group first gathers its members' shards (one ``all_gather_object`` of the
batch, small next to the forward passes it feeds), works on the union, and hands each rank's
results for its own shard back to the controller.
"""

from __future__ import annotations

import torch.distributed as dist

from hybridflow.protocol import Batch


def gather_rows(batch: Batch, group: dist.ProcessGroup | None) -> Batch:
    """The shards of every rank of ``group`` concatenated in rank order (``batch`` itself
    when there is no group). Every rank's shard must have the same length (DP_SPLIT pads)."""
    if group is None or dist.get_world_size(group) == 1:
        return batch
    shards: list[Batch | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, batch, group=group)
    lengths = {len(shard) for shard in shards}
    if len(lengths) > 1:
        raise ValueError(
            f"the ranks of one sequence-parallel group hold shards of {sorted(lengths)} rows; "
            "they must be equal (the controller pads a split batch to a multiple of the ranks)"
        )
    return Batch.concat(shards)


def own_rows(batch: Batch, group: dist.ProcessGroup | None) -> Batch:
    """This rank's shard of a result computed for :func:`gather_rows`'s union."""
    if group is None or dist.get_world_size(group) == 1:
        return batch
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = len(batch) // size
    return batch.index(list(range(rank * rows, (rank + 1) * rows)))
