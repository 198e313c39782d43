import os
import threading
import time

import pytest
from toy_workers import (
    EXPECTED_EXERCISE,
    Counter,
    ReadsPeer,
    RecordsClose,
    Toy,
    closed_lines,
    exercise,
)

from hybridflow.controller import CallTimeoutError, ResourcePool, WorkerError, WorkerGroup, fuse


@pytest.fixture(scope="module")
def group():
    with WorkerGroup(Toy, ResourcePool(cpus=2), "inprocess", scale=3) as g:
        yield g


def test_every_dispatch_mode(group):
    assert exercise(group) == EXPECTED_EXERCISE


def test_worker_exception_names_group_rank_and_remote_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.fail("bad reward", only_rank=1)
    err = info.value
    assert err.rank == 1 and err.method == "fail" and err.group == group.name
    assert "rank 1 failed in fail: ValueError: bad reward" in str(err)
    assert "toy_workers.py" in err.remote_traceback and "raise ValueError(message)" in str(err)


def test_failure_while_building_names_the_rank():
    with pytest.raises(
        WorkerError, match=r"rank 1 failed in Toy.__init__: RuntimeError: cannot build on rank 1"
    ):
        WorkerGroup(Toy, ResourcePool(cpus=2), "inprocess", fail_on_rank=1)


def test_unregistered_and_unknown_methods_fail_on_the_controller(group):
    with pytest.raises(AttributeError, match="not a remote method"):
        group.private_helper()
    with pytest.raises(AttributeError, match="not a remote method"):
        _ = group.no_such_method


def test_two_groups_overlap_and_timeouts_are_enforced():
    a = WorkerGroup(Toy, ResourcePool(cpus=1), "inprocess")
    b = WorkerGroup(Toy, ResourcePool(cpus=1), "inprocess")
    start = time.monotonic()
    fa, fb = a.sleep.remote(0.6), b.sleep.remote(0.6)
    assert fa.get(timeout=5) == [0] and fb.get(timeout=5) == [0]
    assert time.monotonic() - start < 1.1  # sequential would be 1.2 s
    slow = a.sleep.remote(1.0)
    with pytest.raises(CallTimeoutError, match="did not finish within 0.1s"):
        slow.get(timeout=0.1)
    assert slow.get(timeout=5) == [0]  # still valid after a timeout
    a.shutdown()
    b.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        a.sleep(0)


def test_fused_roles_share_one_process_and_see_each_other():
    group = WorkerGroup(
        fuse(counter=Counter, reader=ReadsPeer), ResourcePool(cpus=1), "inprocess", start=2
    )
    assert group.counter.add(5) == 7
    assert group.reader.peer_value() == 7  # the reader holds the counter object itself
    with pytest.raises(AttributeError, match="not a remote method"):
        group.counter.peer_value()
    group.shutdown()


def test_each_rank_runs_on_its_own_thread(group):
    assert threading.current_thread().name not in {
        t.name for t in threading.enumerate() if "Toy" in t.name
    }
    assert group.whoami.remote().get(timeout=5) == EXPECTED_EXERCISE["whoami"]


def test_shutdown_runs_each_workers_close_hook_later_roles_first(tmp_path):
    path = str(tmp_path / "closed")
    group = WorkerGroup(RecordsClose, ResourcePool(cpus=2), "inprocess", path=path)
    assert closed_lines(path) == []
    group.shutdown()
    group.shutdown()  # a second shutdown closes nothing twice
    pid = os.getpid()
    assert closed_lines(path) == [f"closed 0 {pid}", f"closed 1 {pid}"]
    fused = fuse(first=RecordsClose, second=(RecordsClose, {"tag": "second"}))  # built second
    with WorkerGroup(fused, ResourcePool(cpus=1), "inprocess", path=str(tmp_path / "fused")):
        pass
    assert open(tmp_path / "fused").read().splitlines() == [f"second 0 {pid}", f"closed 0 {pid}"]
