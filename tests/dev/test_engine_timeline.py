"""dev/engine_timeline.py: the gap accounting over device intervals, and a CPU run of
the whole script (trace export, phase annotations)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dev"))

import engine_timeline  # noqa: E402


def test_idle_gaps_merges_overlaps_and_names_the_phase():
    kernels = [(0, 10), (5, 12), (20, 30), (30, 31), (40, 50)]
    phases = [("_decode", 0, 15), ("_absorb", 12, 25), ("_admit", 35, 36)]
    ops = [("aten::copy_", 11, 13), ("cudaStreamSynchronize", 11.5, 12.5)]
    r = engine_timeline.idle_gaps(kernels, phases, ops=ops)
    assert r["span_us"] == 50 and r["busy_us"] == 12 + 11 + 10
    assert r["idle_us"] == pytest.approx(8 + 9)
    # gap 12-20 opened while _absorb (started later than _decode) ran; 31-40 outside phases
    assert r["idle_by_phase"] == {"other": 9, "_absorb": 8}
    assert [g["us"] for g in r["largest"]] == [9, 8]
    assert [g["host_op"] for g in r["largest"]] == ["other", "cudaStreamSynchronize"]


@pytest.mark.parametrize("n", [1, 2])
def test_timeline_runs_on_cpu(n):
    r = engine_timeline.timeline("tiny", rows=4, length=8, new_tokens=6,
                                 device=torch.device("cpu"), n=n)  # fmt: skip
    assert r["host_calls"]["_admit"] >= 1 and r["host_calls"]["_absorb"] >= 1
    assert r["profiled_call_us"] > 0 and r["span_us"] == 0  # no device kernels on CPU
    assert set(r["gc_pauses_ms"]) == {"unprofiled", "profiled"}


def test_timeline_rows_must_split_into_samples():
    with pytest.raises(ValueError, match="--rows 5 is not a multiple of --n 2"):
        engine_timeline.timeline("tiny", rows=5, length=8, new_tokens=6,
                                 device=torch.device("cpu"), n=2)  # fmt: skip


def test_kernels_by_phase_follows_the_launch_not_the_kernel_start():
    # A replay launched in _decode runs (on the device) after _absorb has begun on the host:
    # its kernels belong to _decode. A kernel with no known launch falls back to its start.
    records = [("gemm", 30.0, 5.0, 7), ("attn", 36.0, 3.0, 7), ("flash", 12.0, 4.0, 9),
               ("memset", 100.0, 1.0, None)]  # fmt: skip
    launches = {7: 5.0, 9: 11.0}
    phases = [("_decode", 0, 10), ("_admit", 10, 20), ("_absorb", 20, 50)]
    r = engine_timeline.kernels_by_phase(records, launches, phases)
    assert r["_decode"] == {"us": 8.0, "kernels": {"gemm": 5.0, "attn": 3.0}}
    assert r["_admit"]["kernels"] == {"flash": 4.0}
    assert r["other"]["us"] == 1.0


def test_runtime_calls_counts_only_stalling_calls():
    ops = [("cudaHostAlloc", 0, 30), ("cudaLaunchKernel", 30, 31), ("cudaHostAlloc", 40, 45),
           ("cudaEventSynchronize", 50, 60)]  # fmt: skip
    r = engine_timeline.runtime_calls(ops)
    assert r == {"cudaHostAlloc": {"calls": 2, "us": 35.0},
                 "cudaEventSynchronize": {"calls": 1, "us": 10.0}}  # fmt: skip


def test_start_ops_lists_top_level_host_ops_before_the_first_admission():
    ops = [("aten::mul_", 105, 140), ("cudaLaunchKernel", 110, 112), ("aten::copy_", 150, 400),
           ("aten::tolist", 420, 430), ("aten::cat", 600, 700)]  # fmt: skip
    phases = [("_admit", 500, 900), ("_decode", 900, 950)]
    r = engine_timeline.start_ops(ops, phases, (100.0, 1000.0), least_us=30)
    # the launch is inside mul_; tolist is too short; cat is after the first admission
    assert [(o["op"], o["at_us"], o["us"]) for o in r] == [
        ("aten::mul_", 5.0, 35.0), ("aten::copy_", 50.0, 250.0),
        ("(first admission starts)", 400.0, 0.0)]  # fmt: skip
