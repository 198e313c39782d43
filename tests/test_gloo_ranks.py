"""The gloo rank harness (tests/gloo_ranks.py): a rank that leaves its groups has none of
their threads left, even when an object in a reference cycle still held the groups."""

import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_ranks import join_group, leave_group, start_ranks


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _leave_with_groups_held_in_a_cycle(rank: int, world: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    before = _threads()
    join_group(rank, world, port, "cpu")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    # as a learner holds its groups: in a cycle (modules with hooks make them), promoted to
    # the oldest generation, which no automatic collection reaches soon
    holder = {"groups": [mesh.get_group(name) for name in ("dp", "tp")], "mesh": mesh}
    holder["self"] = holder
    for group in holder["groups"]:
        dist.all_reduce(torch.ones(1000), group=group)
    gc.collect()
    del mesh, holder, group
    dist.barrier()
    leave_group()
    Path(out_dir, f"rank{rank}").write_text(f"{before} {_threads()}")


def test_leaving_destroys_the_groups_threads_while_the_rank_runs(tmp_path):
    start_ranks(_leave_with_groups_held_in_a_cycle, 4, str(tmp_path))
    for rank in range(4):
        before, after = map(int, (tmp_path / f"rank{rank}").read_text().split())
        assert after == before, f"rank {rank}: {after - before} threads of its groups remain"
