"""trainer.profile: a CPU step's torch trace, the per-stage summary, the options' checks."""

import json

import pytest
from trainer_helpers import tiny_config

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.trainer.observe.trace_summary import self_times, top_by_region


def test_profile_of_one_cpu_step_writes_a_trace_naming_each_stage(tmp_path, quiet):
    from hybridflow.trainer.lifecycle.run import train

    cfg = tiny_config(
        tmp_path, "trainer.total_steps=1", "trainer.save_freq=-1", "trainer.profile.steps=[1]"
    )
    lines = []
    train(cfg, log=lambda text: lines.append(str(text)))
    trace = json.loads((tmp_path / "run" / "profile" / "step_1" / "controller.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    stages = ("gen", "reward", "adv", "update_actor", "sync_weights", "step")
    assert {f"stage/{stage}" for stage in stages} <= names
    # the worker calls, on the in-process workers' thread, inside the stages
    assert {"rollout.generate", "actor.update", "rollout.sync_from_actor"} <= names
    summary = "\n".join(lines)
    assert "controller.json: top ops by self time" in summary
    assert "update_actor" in summary and "aten::mm" in summary


def op(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}


def test_self_time_subtracts_the_ops_an_op_calls():
    ops = [op("linear", 10, 50), op("addmm", 20, 20), op("copy", 45, 10), op("mul", 70, 5)]
    # linear: 50 - (20 + 10) = 20 of its own
    assert sorted((n, t) for n, _, t in self_times(ops)) == [
        ("addmm", 20), ("copy", 10), ("linear", 20), ("mul", 5)
    ]  # fmt: skip


def test_each_op_goes_to_the_innermost_stage_and_kernels_win_over_ops():
    events = [
        op("stage/step", 0, 300, cat="user_annotation"),
        op("stage/gen", 0, 100, cat="user_annotation"),
        op("stage/update_actor", 100, 100, cat="user_annotation"),
        op("rollout.generate", 5, 90, cat="user_annotation", tid=2),  # a worker thread
        op("mm", 10, 30, tid=2),
        op("mm", 50, 20, tid=2),
        op("add", 120, 40),
        op("cat", 250, 10),  # in the step, outside the other stages
    ]
    kind, table = top_by_region(events, top_k=1)
    assert kind == "ops"
    assert table == {
        "step": [("total", 10.0), ("cat", 10.0)],
        "gen": [("total", 50.0), ("mm", 50.0)],
        "update_actor": [("total", 40.0), ("add", 40.0)],
    }
    kernels = [op("gemm_kernel", 110, 70, cat="kernel"), op("softmax", 130, 5, cat="kernel")]
    kind, table = top_by_region(events + kernels, top_k=5)
    assert kind == "kernels"
    assert table["update_actor"] == [("total", 75.0), ("gemm_kernel", 70.0), ("softmax", 5.0)]


def test_profile_options_are_checked_with_the_fix():
    cfg = load_config(None, ["trainer.total_steps=3", "trainer.profile.steps=[0,2]"])
    cfg2 = load_config(None, ["trainer.profile.tool=perf", "trainer.profile.top_k=0"])
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert "trainer.profile.steps=[0, 2]: [0] not RL steps" in str(error.value)
    assert "1..trainer.total_steps=3" in str(error.value)
    with pytest.raises(ConfigError) as error:
        validate(cfg2)
    assert "trainer.profile.tool='perf': use one of ('torch', 'nvtx')" in str(error.value)
    assert "trainer.profile.top_k=0" in str(error.value)
