"""benchmarks/checkpoint_save.py on CPU: the tiny preset, 2 steps each way."""

from __future__ import annotations

import json

import pytest
from benchmark_run import markdown_rows, number, run_benchmark


def test_prints_a_row_per_setting_consistent_with_the_json(tmp_path):
    out_json = tmp_path / "save.json"
    out = run_benchmark("checkpoint_save.py", "--presets", "tiny", "--steps", "2",
                        "--json", str(out_json))  # fmt: skip
    rows = markdown_rows(out, "| preset |")
    assert [(r["preset"], r["async_save"]) for r in rows] == [("tiny", "false"), ("tiny", "true")]
    results = json.loads(out_json.read_text())
    for row, result in zip(rows, results):
        assert number(row["save step s"]) == pytest.approx(result["save_s"], abs=1e-3)
        assert 0 <= result["wait_previous_s"] <= result["save_s"]
        assert result["checkpoint_gib"] > 0
