"""The `ray` backend on a local 2-CPU Ray. Ray's start-up is the slow part (~10 s on two
cores), so the tests share one Ray and one group; the last test kills a worker."""

import os
import re
import signal
import sys
import time

import pytest
import torch
from toy_workers import (
    EXPECTED_EXERCISE,
    Counter,
    ReadsPeer,
    RecordsClose,
    Toy,
    assert_same_batch,
    closed_lines,
    exercise,
    toy_input,
    trainer_batch,
)

from hybridflow.controller import ResourcePool, WorkerDiedError, WorkerError, WorkerGroup, fuse
from hybridflow.install_hint import extra_install


def test_missing_ray_gives_an_actionable_error(monkeypatch):
    from hybridflow.controller.ray_backend import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=re.escape(extra_install("ray"))):
        import_ray()


def test_ranks_are_grouped_by_node():
    from hybridflow.controller.ray_backend import _contexts, rank_order

    # Actors came up interleaved over two nodes (as a placement group may place them).
    node_ids = ["B", "A", "B", "A"]
    order = rank_order(node_ids)
    assert order == [0, 2, 1, 3]  # node B's actors first (seen first), then node A's
    nodes = [("10.0.0.2", node_ids[i], 100 + i) for i in order]
    contexts = _contexts(nodes, ResourcePool(gpus=[2, 2]), "g")
    assert [(c.rank, c.local_rank, c.local_world_size) for c in contexts] == [
        (0, 0, 2),
        (1, 1, 2),
        (2, 0, 2),
        (3, 1, 2),
    ]
    assert {c.device for c in contexts} == {"cuda:0"} and contexts[0].world_size == 4


def test_joins_a_running_cluster_else_starts_one(monkeypatch):
    from hybridflow.controller import ray_backend

    calls = []

    class FakeRay:
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            calls.append(kwargs)
            if kwargs.get("address") == "auto":
                raise ConnectionError("Could not find any running Ray instance")

    monkeypatch.setattr(ray_backend, "import_ray", FakeRay)
    ray_backend.ensure_ray_initialized()
    assert calls == [{"address": "auto"}, {}]


@pytest.fixture(scope="module")
def group():
    ray = pytest.importorskip("ray")
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # Half a CPU per worker leaves room for a second group on the 2-CPU Ray.
    pool = ResourcePool(cpus=2, cpus_per_worker=0.5)
    group = WorkerGroup(Toy, pool, "ray", scale=3, call_timeout_s=120)
    yield group
    group.shutdown()
    if started_here:
        ray.shutdown()


def test_same_results_as_inprocess(group):
    assert exercise(group) == EXPECTED_EXERCISE
    assert os.getpid() not in group.pids()


def test_collectives_and_large_batches(group):
    assert group.sum_of_ranks() == 1
    batch = toy_input(1024)
    out = group.transform(batch)
    assert out["uid"].tolist() == batch["uid"].tolist()
    out["y"][0, 0] = -1  # tensors from the object store come back writable


def test_every_trainer_dtype_round_trips_both_ways(group):
    batch = trainer_batch()
    for got in group.echo({"batch": batch, "scalar": torch.tensor(True)}):
        assert_same_batch(got["batch"], batch)
        assert got["scalar"].dtype == torch.bool and got["scalar"].shape == ()


def test_ranks_given_one_stored_tensor_write_to_copies_of_their_own(group):
    sent = torch.arange(1 << 18)  # 2 MiB: put in the object store once for both ranks
    assert group.write_then_read(sent) == [0, -1]
    assert sent[0] == 0


def test_exception_names_rank_and_remote_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.fail("sandbox crashed", only_rank=1)
    assert "rank 1 failed in fail: ValueError: sandbox crashed" in str(info.value)
    assert 'toy_workers.py", line' in info.value.remote_traceback


def test_fused_roles_on_ray(group):
    pool = ResourcePool(cpus=1, cpus_per_worker=0.5)
    with WorkerGroup(fuse(counter=Counter, reader=ReadsPeer), pool, "ray", start=4) as fused:
        assert fused.counter.add(1) == 5 and fused.reader.peer_value() == 5


def test_shutdown_runs_the_close_hook_in_each_actor(group, tmp_path):
    path = str(tmp_path / "closed")
    pool = ResourcePool(cpus=2, cpus_per_worker=0.5)
    closing = WorkerGroup(RecordsClose, pool, "ray", path=path)
    pids = closing.pids()
    closing.shutdown()
    assert closed_lines(path) == [f"closed 0 {pids[0]}", f"closed 1 {pids[1]}"]


def test_killed_actor_is_detected_quickly(group):
    future = group.sleep.remote(60)
    time.sleep(0.5)
    os.kill(group.pids()[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        future.get(timeout=60)
    assert time.monotonic() - start < 10
