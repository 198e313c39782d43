"""Run a test function on several CPU processes joined by a gloo process group.

``run_ranks(fn, world, *args)`` spawns ``world`` processes; each calls ``fn(rank, world,
*args)`` inside an initialised default group. ``fn`` must be a module-level function (spawn
pickles it by name); an assertion that fails on any rank fails the test with that rank's
traceback."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears the group down while another still talks
    finally:
        dist.destroy_process_group()


def join_group(rank: int, world: int, port: int, device_type: str) -> torch.device:
    """Initialise a spawned rank's default group and return its device: NCCL on GPU ``rank``
    (NVLink multicast off, as the multi-GPU machines need), gloo on the CPU, so a GPU test's
    worker also runs on CPU processes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        return device
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return torch.device("cpu")


def start_ranks(entry, world: int, *args, attempts: int = 2) -> None:
    """Spawn ``world`` processes running ``entry(rank, world, port, *args)``. A run in which a
    rank was killed by SIGABRT is run once more: gloo's C++ threads can call std::terminate
    while the ranks tear their connections down on a loaded host (seen once in a full suite
    run, never in isolation). A rank that raises, or aborts again, fails the test."""
    for attempt in range(1, attempts + 1):
        try:
            mp.start_processes(
                entry, args=(world, free_port(), *args), nprocs=world, start_method="spawn"
            )
            return
        except mp.ProcessExitedException as exited:
            if exited.signal_name != "SIGABRT" or attempt == attempts:
                raise
            print(f"gloo_ranks: {exited}; running the {world} ranks again", file=sys.stderr)


def _run_fn(rank: int, world: int, port: int, fn, args: tuple) -> None:
    _entry(rank, fn, world, port, args)


def run_ranks(fn, world: int, *args) -> None:
    start_ranks(_run_fn, world, fn, args)
