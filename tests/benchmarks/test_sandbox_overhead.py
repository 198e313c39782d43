"""benchmarks/sandbox_overhead.py on CPU: a row per isolation the machine allows, with
positive times, and strict's row where the jail is possible."""

from __future__ import annotations

import sys

import pytest
from benchmark_run import run_benchmark

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox is Linux-only", allow_module_level=True)


def test_prints_one_row_per_isolation_with_positive_costs():
    from hybridflow.agents.sandbox import jail_unavailable

    out = run_benchmark("sandbox_overhead.py", "--programs", "3", "--concurrency", "2")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("isolation"))
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[header + 2 :]}
    assert list(rows) == ["basic"] if jail_unavailable() else ["basic", "strict"]
    for values in rows.values():
        median_ms, fastest_ms, cpu_ms, rate, _ = values
        assert 0 < fastest_ms <= median_ms and cpu_ms > 0 and rate > 0
    assert rows["basic"][4] == 0.0
