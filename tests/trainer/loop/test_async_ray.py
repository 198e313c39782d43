"""The async mode on the ``ray`` backend (a local 2-CPU Ray, started once for the module):
staleness 1 gives the in-process run metric for metric, and partial rollouts stay within
the bound. Each actor runs one call at a time, in the order this process submitted them, as
a local worker does with its pipe; the rollout producer's calls and the trainer's
interleave there."""

from __future__ import annotations

import pytest
from test_async import _comparable, _run
from test_partial_rollout import PARTIAL, _trained_batches
from trainer_helpers import read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import train


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray = pytest.importorskip("ray")
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started_here:
        ray.shutdown()


def test_staleness_one_on_ray_equals_the_inprocess_run(tmp_path):
    args = ("trainer.mode=async", "trainer.max_staleness=1")
    inprocess = _run(tmp_path, "inprocess", *args)
    on_ray = _run(tmp_path, "ray", *args, "trainer.backend=ray")
    assert [on_ray[step]["async/staleness"] for step in range(1, 5)] == [0, 1, 1, 1]
    assert _comparable(on_ray) == _comparable(inprocess)


def test_partial_rollouts_on_ray_stay_within_the_bound(tmp_path, monkeypatch):
    """The generation runs on a thread of the rollout actor; the trainer's weight syncs
    reach the actor between the producer's short `generated` waits. Every trained sample,
    by its recorded token versions, lags at most s = 1 versions."""
    taken = _trained_batches(monkeypatch)
    cfg = tiny_config(tmp_path, "trainer.total_steps=3", "trainer.max_staleness=1",
                      "trainer.backend=ray", *PARTIAL)  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    assert sorted(taken) == [1, 2, 3]
    for step, batch in taken.items():
        mask = batch.tensors["response_mask"].bool()
        versions = batch.tensors["token_versions"][mask]
        assert int(versions.min()) >= step - 2 and int(versions.max()) <= step - 1
    metrics = read_metrics(cfg.trainer.run_dir)
    assert all(metrics[step]["async/staleness_max"] <= 1 for step in (1, 2, 3))
