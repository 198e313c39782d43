"""The `local` backend: worker processes, gloo, shared-memory transport, failure handling.

Each group start costs a few seconds (torch.distributed's start, the workers' own imports), so
the tests share one group where they can. How workers start: test_fork_server.py.
"""

import glob
import os
import signal
import sys
import threading
import time
import types

import psutil
import pytest
import torch
from toy_workers import (
    EXPECTED_EXERCISE,
    Counter,
    ReadsPeer,
    RecordsClose,
    Toy,
    closed_lines,
    exercise,
    toy_input,
)

from hybridflow.controller import (
    ResourcePool,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    fuse,
)
from hybridflow.controller.segment_pool import SegmentPool


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def child_pids() -> set[int]:
    """Our descendants, minus multiprocessing's resource tracker and fork server (one per
    controller, kept for its later groups)."""
    me = psutil.Process()
    helpers = {p.pid for p in me.children()  # the workers forked from the server are counted
               if any(h in " ".join(p.cmdline()) for h in ("resource_tracker", "forkserver"))}  # fmt: skip
    return {p.pid for p in me.children(recursive=True)} - helpers


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def group():
    with WorkerGroup(Toy, ResourcePool(cpus=2), "local", scale=3, call_timeout_s=60) as g:
        yield g


def test_rendezvous_store_listens_on_localhost_only(group):
    # rank 0 serves the store; torch's default would listen on every interface ("*")
    assert group.rendezvous_listeners() == [["127.0.0.1"], []]


def test_same_results_as_inprocess(group):
    assert exercise(group) == EXPECTED_EXERCISE
    pids = group.pids()
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert group.pid() == pids


def test_collectives_run_over_gloo(group):
    assert group.sum_of_ranks() == 0 + 1


def test_large_batch_round_trip_through_shared_memory(group, monkeypatch):
    writes = []

    def spy(self, *args, **kwargs):
        writes.append(write(self, *args, **kwargs))
        return writes[-1]

    write = SegmentPool.write
    monkeypatch.setattr(SegmentPool, "write", spy)
    for scale in (1, 2):
        batch = toy_input(2048, cols=128)  # 2 MiB of int64
        batch["x"] *= scale
        out = group.transform(batch)
        assert out["y"].shape == (2048, 128) and out["uid"].tolist() == batch["uid"].tolist()
        assert torch.equal(out["y"], batch["x"] * 3 + batch["x"].sum(dim=1, keepdim=True))
        assert out["rank"].tolist() == [0] * 1024 + [1] * 1024
    # One segment for both ranks, written again at the next call (both ranks released it).
    assert [(name, generation) for name, generation, _ in writes] == [
        (writes[0][0], 1),
        (writes[0][0], 2),
    ]
    # Its file is removed once both mapped it.
    deadline = time.monotonic() + 2
    while glob.glob(f"/dev/shm/hybridflow-{os.getpid()}-*") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert glob.glob(f"/dev/shm/hybridflow-{os.getpid()}-*") == []


def test_a_batch_a_worker_keeps_reads_its_own_bytes_after_later_calls(group):
    kept = toy_input(2048, cols=128)  # 2 MiB: through shared memory
    group.keep(kept)
    for scale in (2, 3):
        later = toy_input(2048, cols=128)
        later["x"] *= scale
        group.transform(later)
    assert group.kept_sum() == [int(kept["x"].sum())] * 2


def test_exception_names_rank_and_carries_remote_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.fail("no reward function", only_rank=1)
    assert "group 'Toy" in str(info.value) and "rank 1 failed in fail" in str(info.value)
    assert "ValueError: no reward function" in info.value.remote_traceback
    assert 'toy_workers.py", line' in info.value.remote_traceback
    assert group.add_rank([1, 1]) == [1, 2]  # the group keeps working after a worker exception


def test_futures_of_two_groups_overlap(group):
    other = WorkerGroup(Toy, ResourcePool(cpus=1), "inprocess")
    start = time.monotonic()
    first, second = group.sleep.remote(1.0), other.sleep.remote(1.0)
    assert first.get(timeout=30) == [0, 1] and second.get(timeout=30) == [0]
    assert time.monotonic() - start < 1.8  # sequential: >= 2 s
    other.shutdown()


def test_shutdown_runs_the_close_hook_in_each_worker_process(tmp_path):
    path = str(tmp_path / "closed")
    group = WorkerGroup(RecordsClose, ResourcePool(cpus=2), "local", path=path)
    pids = group.pids()
    group.shutdown()
    assert closed_lines(path) == [f"closed 0 {pids[0]}", f"closed 1 {pids[1]}"]


def test_fused_roles_pickle_into_worker_processes():
    with WorkerGroup(
        fuse(counter=Counter, reader=ReadsPeer), ResourcePool(cpus=1), "local", start=1
    ) as g:
        assert g.counter.add(2) == 3 and g.reader.peer_value() == 3


def test_collective_timeout_then_killed_worker_detected_quickly_and_group_shut_down():
    group = WorkerGroup(Toy, ResourcePool(cpus=2), "local", collective_timeout_s=2)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed in barrier_on") as info:
        group.barrier_on([1])  # rank 0 never joins
    assert time.monotonic() - start < 20
    assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower()
    pids = group.pids()
    child = group.start_child()[0]
    future = group.sleep.remote(60)
    time.sleep(0.5)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1") as info:
        future.get(timeout=60)
    assert time.monotonic() - start < 10
    assert "exited with code -9" in str(info.value)
    # The survivor (stuck in a 60 s call) and the grandchild are killed too.
    assert wait_gone([pids[0], child], timeout_s=10)


def test_failure_while_building_reports_rank_and_leaves_no_process():
    before = child_pids()
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed in Toy.__init__: RuntimeError: cannot"):
        # Rank 0 waits in a barrier for rank 1: the error must not wait for rank 0.
        WorkerGroup(Toy, ResourcePool(cpus=2), "local", fail_on_rank=1, start_timeout_s=120)
    assert time.monotonic() - start < 60
    after = child_pids()
    assert wait_gone(list(after - before))


def test_arguments_the_worker_cannot_unpickle_fail_that_call_only(group, monkeypatch):
    ghost = types.ModuleType("ghost_module_only_in_the_controller")
    exec("class Ghost:\n    pass", ghost.__dict__)
    monkeypatch.setitem(sys.modules, ghost.__name__, ghost)
    with pytest.raises(WorkerError, match="could not unpickle the arguments"):
        group.echo(ghost.Ghost())
    assert group.add_rank([5, 5]) == [5, 6]  # the next call is matched to its own reply


def test_a_start_that_fails_before_the_workers_answer_reports_its_own_error():
    # an init argument pickle cannot send fails while the group starts, before any worker
    # answered: shutdown used to raise AttributeError over it (no start outcomes yet)
    with pytest.raises(Exception) as failed:
        WorkerGroup(Toy, ResourcePool(cpus=1), "local", scale=threading.Lock())
    assert "pickle" in str(failed.value), repr(failed.value)  # not "'NoneType' ... 'error'"
