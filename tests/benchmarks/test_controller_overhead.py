"""benchmarks/controller_overhead.py on CPU: the inprocess and local backends, a small GRPO batch."""

from __future__ import annotations

import math

import pytest
from benchmark_run import run_benchmark

CALLS = ["noop", "update", "one_to_all", "logprobs"]


@pytest.mark.slow
def test_prints_each_call_of_each_backend_with_positive_times():
    out = run_benchmark(
        "controller_overhead.py", "--backends", "inprocess", "local", "--world-size", "2",
        "--rows", "64", "--prompt-len", "32", "--response-len", "480", "--repeats", "2",
    )  # fmt: skip
    assert "GRPO update batch: 64 x 512 tokens" in out and "world size 2" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("backend"))
    rows = [line.split() for line in lines[header + 2 :] if line.strip()]
    assert [(r[0], r[1]) for r in rows] == [(b, c) for b in ("inprocess", "local") for c in CALLS]
    for backend, call, mib, ms, *rate in rows:
        assert math.isfinite(float(ms)) and float(ms) > 0, (backend, call)
        assert (float(mib) > 0) == (call != "noop") and len(rate) == (call != "noop")
    update = {r[0]: float(r[2]) for r in rows if r[1] == "update"}
    one_to_all = {r[0]: float(r[2]) for r in rows if r[1] == "one_to_all"}
    assert one_to_all["local"] == pytest.approx(2 * update["local"], abs=0.1)  # to each of 2 ranks
