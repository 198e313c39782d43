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
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels on the CPU
    out = run_benchmark("moe_layer.py", "--device", "cpu", "--quick", "--align",
                        "--out", str(tmp_path))  # fmt: skip
    rows = markdown_rows(out, "| tokens | pairs |")
    assert [row["experts"] for row in rows] == ["all experts", "1/2 experts"]
    assert all(number(row["align_pairs us"]) > 0 for row in rows)
    assert len(json.loads((tmp_path / "moe_align.json").read_text())["rows"]) == 2
