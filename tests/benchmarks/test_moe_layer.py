"""benchmarks/moe_layer.py on CPU (--quick): the table of expert paths at a tiny shape."""

from __future__ import annotations

import json

from benchmark_run import markdown_rows, number, run_benchmark


def test_quick_run_prints_each_path_with_its_error(tmp_path):
    out = run_benchmark("moe_layer.py", "--device", "cpu", "--quick", "--out", str(tmp_path),
                        "--expert-share", "2")  # fmt: skip
    rows = markdown_rows(out, "| tokens |")
    paths = [row["path"] for row in rows]
    assert "trainer grouped fwd" in paths and "per-expert loop fwd" in paths
    assert "trainer grouped fwd+bwd" in paths
    assert "trainer grouped fwd, 1/2 experts" in paths  # one rank's share of rollout TP 2
    for row in rows:
        assert number(row["ms"]) > 0 and number(row["floor ms"]) > 0
        assert float(row["rel. error"]) < 1e-5  # fp32 on the CPU
    result = json.loads((tmp_path / "moe_layer.json").read_text())
    assert result["table"] in out


def test_align_mode_times_the_sort_by_expert_alone(tmp_path, monkeypatch):
    """align_pairs, its count launch and the former one-launch sort (which the script checks
    gives the same blocks), for all experts and a half share."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels on the CPU
    out = run_benchmark("moe_layer.py", "--device", "cpu", "--quick", "--align",
                        "--out", str(tmp_path))  # fmt: skip
    rows = markdown_rows(out, "| tokens | pairs |")
    sorts = ["align_pairs", "its count launch", "one launch, histogram (before)"]
    assert [(row["experts"], row["sort"]) for row in rows] == [
        (share, sort) for share in ("all", "1/2") for sort in sorts
    ]
    assert all(number(row["us"]) > 0 for row in rows)
    assert len(json.loads((tmp_path / "moe_align.json").read_text())["rows"]) == 6
