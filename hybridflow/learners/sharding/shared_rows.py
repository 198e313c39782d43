"""Rows shared by the ranks that split one model.

The controller splits a batch over every rank of a role (``Dispatch.DP_SPLIT``), whatever its
layout. Ranks that split one model replica, over its sequence (Ulysses) or its layers
(tensor parallelism), must work on the same rows, so each replica first gathers its members'
shards (an ``all_gather_object`` of the batch per group, small next to the forward passes it
feeds), works on the union, and hands each rank's results for its own shard back to the
controller.
"""

from __future__ import annotations

import torch.distributed as dist

from hybridflow.protocol import Batch


def gather_rows(batch: Batch, groups: list[dist.ProcessGroup]) -> Batch:
    """The shards of every rank of the replica concatenated in rank order (``batch`` itself
    for no groups). ``groups``: the tensor- and sequence-parallel groups, innermost first; each
    rank's shard must have the same length (DP_SPLIT pads)."""
    for group in groups:  # innermost first: the union ends in global rank order
        shards: list[Batch | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(shards, batch, group=group)
        lengths = {len(shard) for shard in shards}
        if len(lengths) > 1:
            raise ValueError(
                f"the ranks of one model replica hold shards of {sorted(lengths)} rows; they "
                "must be equal (the controller pads a split batch to a multiple of the ranks)"
            )
        batch = Batch.concat(shards)
    return batch


def own_rows(batch: Batch, groups: list[dist.ProcessGroup]) -> Batch:
    """This rank's shard of a result computed for :func:`gather_rows`'s union."""
    index, replica = 0, 1
    for group in groups:
        index += dist.get_rank(group) * replica
        replica *= dist.get_world_size(group)
    rows = len(batch) // replica
    return batch if replica == 1 else batch.index(list(range(index * rows, (index + 1) * rows)))
