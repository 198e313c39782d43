"""Run a test function on several CPU processes joined by a gloo process group.

``run_ranks(fn, world, *args)`` spawns ``world`` processes; each calls ``fn(rank, world,
*args)`` inside an initialised default group. ``fn`` must be a module-level function (spawn
pickles it by name); an assertion that fails on any rank fails the test with that rank's
traceback.

Every rank leaves through :func:`leave_group`, which destroys its groups while Python is whole
(why: its docstring)."""

from __future__ import annotations

import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.controller.fork_server import WORKER_PRELOAD


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
        leave_group()


def leave_group() -> None:
    """Destroy this rank's process groups, their C++ side included, before the process exits.

    ``destroy_process_group`` only unregisters the groups: a group's gloo worker threads and
    device loop live on while any Python object still refers to it (a DeviceMesh, an FSDP
    module, a learner), and such objects often sit in reference cycles that only a collection
    frees. Such a group is then torn down during the interpreter's shutdown, or not at all
    before exit(), with its threads still running (one may still hold the last reference to a
    collective's tensor, which needs the GIL to free): now and then, mostly on a loaded host,
    the rank aborts after its test passed ("terminate called without an active exception",
    SIGABRT). Collecting here destroys those groups while Python is whole (pybind11 destroys
    c10d objects with the GIL released, so their threads finish and are joined)."""
    dist.destroy_process_group()
    gc.collect()


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


def start_ranks(entry, world: int, *args) -> None:
    """Spawn ``world`` processes running ``entry(rank, world, port, *args)``; an entry that
    joins a group itself ends with :func:`leave_group`. A rank that raises or dies fails the
    test.

    The ranks fork from multiprocessing's fork server, a fresh interpreter (not a fork of
    pytest: no thread or state of the tests is inherited) started once per test session that
    has imported the local backend's WORKER_PRELOAD (controller/fork_server.py, whose workers
    share the server), instead of each rank starting Python and importing torch."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts (the first call)
    mp.start_processes(entry, args=(world, free_port(), *args), nprocs=world,
                       start_method="forkserver")  # fmt: skip


def _run_fn(rank: int, world: int, port: int, fn, args: tuple) -> None:
    _entry(rank, fn, world, port, args)


def run_ranks(fn, world: int, *args) -> None:
    start_ranks(_run_fn, world, fn, args)
