"""benchmarks/checkpoint_save.py on CPU: the tiny preset, 2 steps each way."""

from __future__ import annotations

import json

import pytest
from benchmark_run import markdown_rows, number, run_benchmark


@pytest.mark.slow  # two child runs of the trainer
def test_prints_a_row_per_setting_consistent_with_the_json(tmp_path):
    out_json = tmp_path / "save.json"
    out = run_benchmark("checkpoint_save.py", "--presets", "tiny", "--steps", "2",
                        "--json", str(out_json))  # fmt: skip
    rows = markdown_rows(out, "| preset |")
    assert [(r["preset"], r["async_save"]) for r in rows] == [("tiny", "false"), ("tiny", "true")]
    results = json.loads(out_json.read_text())
    for row, result in zip(rows, results):
        assert len(result["save_s_by_step"]) == 2  # a save every step
        assert number(row["first save s"]) == pytest.approx(result["save_s_by_step"][0], abs=1e-3)
        assert number(row["later saves s"]) == pytest.approx(result["save_s_by_step"][1], abs=1e-3)
        assert 0 <= result["later_wait_previous_s"] <= result["later_save_s"]
        assert result["checkpoint_gib"] > 0
