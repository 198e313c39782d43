"""benchmarks/controller_overhead.py on CPU: the inprocess and local backends, a small Batch."""

from __future__ import annotations

import math

import pytest
from benchmark_run import run_benchmark

COLUMNS = ("start s", "noop us", "send ms", "send MiB/s", "echo ms", "echo MiB/s")


@pytest.mark.slow
def test_prints_one_row_per_backend_with_positive_times():
    out = run_benchmark(
        "controller_overhead.py", "--backends", "inprocess", "local", "--world-size", "2",
        "--rows", "256", "--cols", "512", "--repeats", "3",
    )  # fmt: skip
    assert "Batch: 256 x 512 int64 = 1 MiB; world size 2" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("backend"))
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[header + 2 :]}
    assert list(rows) == ["inprocess", "local"]
    for backend, values in rows.items():
        assert len(values) == len(COLUMNS), (backend, values)
        assert all(math.isfinite(v) and v >= 0 for v in values), (backend, values)
        measured = dict(zip(COLUMNS, values))
        assert measured["noop us"] > 0 and measured["send MiB/s"] > 0
        assert measured["echo MiB/s"] > 0
    # Only the local backend starts processes and pickles or maps tensors across them.
    assert rows["local"][0] > rows["inprocess"][0]
