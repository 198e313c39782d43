"""benchmarks/shared_memory_steps.py: every step timed (to 0.1 ms), on a small buffer, leaving no file."""

from __future__ import annotations

import glob
import math

from benchmark_run import run_benchmark


def test_prints_every_step_and_cleans_up():
    out = run_benchmark("shared_memory_steps.py", "--mib", "4", "--rounds", "1")
    assert out.startswith("4 MiB, 1 rounds")
    rows = {line[:58].strip(): float(line[58:].split()[0]) for line in out.splitlines()[1:]}
    assert len(rows) == 12 and all(math.isfinite(ms) and ms >= 0 for ms in rows.values())
    assert "reused segment: np.copyto per column (used)" in rows
    assert glob.glob("/dev/shm/hybridflow-steps-*") == []
