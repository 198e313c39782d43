"""Async mode (trainer/loop/async_rollout.py): at staleness 0 it is the synchronous run, metric for
metric; with staleness 1 every batch lags exactly as scheduled, the run is reproducible,
and stop + resume equals a straight run; a stalled or failing producer stops the run."""

from __future__ import annotations

import time

import pytest
from trainer_helpers import CLOCKED, read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import train
from hybridflow.trainer.loop.async_rollout import (
    RolloutProducer,
    RolloutStalled,
    generation_version,
)

NOT_COMPARED = ("timing_s/", "perf/", "async/", "memory/", *CLOCKED)


def _comparable(rows: dict) -> dict:
    return {step: {k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)}
            for step, row in rows.items()}  # fmt: skip


def _run(tmp_path, name: str, *overrides: str) -> dict:
    cfg = tiny_config(tmp_path / name, "trainer.total_steps=4", "trainer.save_freq=-1",
                      *overrides)  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    return read_metrics(cfg.trainer.run_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Metrics of the 4-step run with these overrides, run once for the module: runs are
    deterministic (the tests below check it), so tests comparing the same settings share
    them. ``again``: a second run of the same settings, for the reproducibility check."""
    done: dict = {}

    def run(*overrides: str, again: bool = False) -> dict:
        if (overrides, again) not in done:
            done[overrides, again] = _run(tmp_path_factory.mktemp("run"), "run", *overrides)
        return done[overrides, again]

    return run


ASYNC_1 = ("trainer.mode=async", "trainer.max_staleness=1")


def test_generation_versions_lag_by_the_staleness_and_wait_for_checkpoints():
    never = lambda step: False  # noqa: E731
    assert [generation_version(j, 0, never) for j in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [generation_version(j, 1, never) for j in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [generation_version(j, 2, never) for j in range(1, 6)] == [0, 0, 0, 1, 2]
    every_2 = lambda step: step % 2 == 0  # noqa: E731
    # after the checkpoint of step 2, step 3 waits for its weights (resume regenerates it)
    assert [generation_version(j, 1, every_2) for j in range(1, 6)] == [0, 0, 2, 2, 4]


@pytest.mark.parametrize("backend", ["inprocess", "local"])
def test_staleness_zero_is_the_synchronous_run(runs, backend):
    """Against the in-process synchronous run on both backends: the worker processes'
    runs equal the in-process ones (test_staleness_one_on_the_local_backend_...)."""
    sync = runs()
    asynchronous = runs(f"trainer.backend={backend}", "trainer.mode=async",
                        "trainer.max_staleness=0")  # fmt: skip
    assert _comparable(asynchronous) == _comparable(sync)
    assert all(asynchronous[step]["async/staleness"] == 0 for step in range(1, 5))


def test_staleness_one_lags_as_scheduled_and_reproduces(runs):
    first = runs(*ASYNC_1)
    again = runs(*ASYNC_1, again=True)
    assert [first[step]["async/staleness"] for step in range(1, 5)] == [0, 1, 1, 1]
    assert _comparable(first) == _comparable(again)  # the schedule does not depend on timing
    sync = runs()

    def rollout_side(row):  # what the samples alone decide
        return {k: v for k, v in row.items() if "score" in k or "response_length" in k}

    assert rollout_side(first[1]) and rollout_side(first[1]) == rollout_side(sync[1])
    assert rollout_side(first[3]) != rollout_side(sync[3])  # later batches: one version behind
    assert first[2]["actor/rollout_is/abs_log_ratio"] > first[1]["actor/rollout_is/abs_log_ratio"]


def test_staleness_one_on_the_local_backend_equals_the_inprocess_run(runs):
    """The schedule is exact: worker processes (calls of the trainer and the producer
    interleaved on one pipe per worker) give the in-process run, metric for metric."""
    inprocess = runs(*ASYNC_1)
    local = runs(*ASYNC_1, "trainer.backend=local")
    assert [local[step]["async/staleness"] for step in range(1, 5)] == [0, 1, 1, 1]
    assert _comparable(local) == _comparable(inprocess)


def test_stop_and_resume_equal_a_straight_async_run(tmp_path):
    args = ("trainer.mode=async", "trainer.max_staleness=1", "trainer.save_freq=2")
    straight = tiny_config(tmp_path / "straight", "trainer.total_steps=4", *args)
    train(straight, log=lambda *a, **k: None)
    stopped = tiny_config(tmp_path / "resumed", "trainer.total_steps=2", *args)
    train(stopped, log=lambda *a, **k: None)
    resumed = tiny_config(tmp_path / "resumed", "trainer.total_steps=4", *args)
    train(resumed, log=lambda *a, **k: None)
    a = _comparable(read_metrics(straight.trainer.run_dir))
    b = _comparable(read_metrics(resumed.trainer.run_dir))
    assert a[3] == b[3] and a[4] == b[4]


def test_a_stalled_producer_is_named_within_the_timeout():
    def slow(step, attempt):
        time.sleep(5)
        return None, {}

    producer = RolloutProducer(slow, 1, 3, 1, lambda s: False, installed=0, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(RolloutStalled, match="rollout of step 1 from the rollout producer"):
        producer.take(1)
    assert time.monotonic() - started < 2
    producer.closing = True


def test_a_failing_producer_stops_the_trainer_with_its_error():
    def broken(step, attempt):
        raise ValueError("the reward server is down")

    producer = RolloutProducer(broken, 1, 3, 0, lambda s: False, installed=0, timeout_s=5)
    with pytest.raises(ValueError, match="the reward server is down") as error:
        producer.take(1)
    assert any("async rollout producer" in note for note in error.value.__notes__)
    producer.close()


def test_a_killed_rollout_process_is_named_and_leaves_no_orphans(tmp_path, monkeypatch):
    """local backend, async mode: the rollout worker is killed while the producer generates
    step 2; the run stops with the dead worker named (role, rank) within seconds, and no
    worker process is left."""
    import os
    import signal

    from hybridflow.controller.errors import WorkerDiedError
    from hybridflow.trainer.loop import stages

    real, calls, pids = stages.generate, [], []

    def generate(run, prompts, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # step 2's rollout, on the producer's thread
            pids.extend(pid for group in run.roles.groups for pid in group.pids())
            os.kill(pids[0], signal.SIGKILL)
        return real(run, prompts, **kwargs)

    monkeypatch.setattr(stages, "generate", generate)
    cfg = tiny_config(tmp_path, "trainer.backend=local", "trainer.mode=async",
                      "trainer.max_staleness=0", "trainer.total_steps=3",
                      "trainer.val_before_train=false")  # fmt: skip
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 0"):
        train(cfg, log=lambda *a, **k: None)
    assert time.monotonic() - started < 120
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def test_async_settings_are_checked():
    from hybridflow.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match="trainer.mode = 'later' is unknown"):
        validate(load_config(None, ["trainer.mode=later"]))
    # every backend runs the async mode with staleness (tests/trainer/loop/test_async_ray.py)
    validate(load_config(None, ["trainer.mode=async", "trainer.max_staleness=2",
                                "trainer.partial_rollout=true", "trainer.backend=ray",
                                "trainer.n_gpus_per_node=2", "trainer.device=cpu"]))  # fmt: skip
