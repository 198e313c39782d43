"""build_mesh on 2 and 4 gloo processes: each named group of the DeviceMesh holds exactly the
ranks the pure arithmetic says, and a collective over it reaches only them."""

import os

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import leave_group, start_ranks

from hybridflow.parallel.layout import (
    build_mesh,
    coordinates,
    ranks_with,
    rollout_layout,
    train_layout,
)


def _check_layouts(rank: int, world: int, port: int, layouts: list, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        seen = []
        for layout in layouts:
            role = build_mesh(layout, "cpu")
            for name in layout.named_groups:
                members = [torch.zeros(1, dtype=torch.int64) for _ in range(role.size(name))]
                dist.all_gather(members, torch.tensor([rank]), group=role.group(name))
                seen.append(
                    (
                        name,
                        [int(m) for m in members],
                        role.rank_in(name),
                        ranks_with(layout, name, rank),
                        coordinates(layout, rank)[name],
                    )
                )
        torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears the group down while another still talks
    finally:
        leave_group()


def _run(world: int, layouts: list, tmp_path) -> None:
    start_ranks(_check_layouts, world, layouts, str(tmp_path))
    for rank in range(world):
        for name, gathered, local_rank, expected, expected_local in torch.load(
            tmp_path / f"rank{rank}.pt"
        ):
            assert gathered == expected, (rank, name)
            assert local_rank == expected_local, (rank, name)


def test_two_processes_sp2_and_rollout_tp2(tmp_path):
    _run(2, [train_layout(2, sp=2), rollout_layout(2, tp=2), train_layout(2)], tmp_path)


@pytest.mark.slow
def test_four_processes_tp_sp_ep(tmp_path):
    layouts = [
        train_layout(4, tp=2, sp=2),
        train_layout(4, sp=2, ep=4),
        train_layout(4, tp=2, ep=2),
        rollout_layout(4, tp=2, ep=4),
    ]
    _run(4, layouts, tmp_path)
