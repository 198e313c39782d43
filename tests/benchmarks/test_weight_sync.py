"""benchmarks/weight_sync.py on CPU: two gloo processes, the tiny preset into a rollout of TP = 2;
the reshard moves the plan's bytes, fewer than gathering whole tensors, in buckets no larger
than asked."""

from __future__ import annotations

import pytest
from benchmark_run import markdown_rows, run_benchmark


@pytest.mark.slow
def test_prints_the_reshard_beside_the_gather_with_the_plans_bytes():
    out = run_benchmark("weight_sync.py", "--model", "tiny", "--world", "2", "--repeats", "1",
                        "--bucket-mb", "1")  # fmt: skip
    rows = {row["way"]: row for row in markdown_rows(out, "| way")}
    reshard, gather = rows["reshard"], rows["gather"]
    assert reshard["MiB received"] == reshard["plan"] and gather["MiB received"] == gather["plan"]
    assert 0 < float(reshard["MiB received"]) < float(gather["MiB received"])
    assert 0 < float(reshard["transient MiB"]) <= 1.0
    assert float(reshard["s a sync"]) > 0 and float(gather["s a sync"]) > 0
