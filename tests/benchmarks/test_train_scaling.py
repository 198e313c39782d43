"""benchmarks/train_scaling.py on CPU: the tiny model's actor update on 1 and 2 gloo ranks."""

from __future__ import annotations

import json

import pytest
from benchmark_run import markdown_rows, number, run_benchmark


@pytest.mark.slow
def test_prints_one_row_per_rank_count_with_scaling_efficiency(tmp_path):
    out_json = tmp_path / "scaling.json"
    out = run_benchmark(
        "train_scaling.py", "--model", "tiny", "--gpus", "1", "2", "--rows-per-gpu", "4",
        "--prompt-len", "8", "--response-len", "8", "--max-tokens", "64", "--minis", "1",
        "--steps", "1", "--configs", "fsdp", "--json", str(out_json),
    )  # fmt: skip
    rows = markdown_rows(out, "| GPUs |")
    assert [(r["GPUs"], r["config"]) for r in rows] == [("1", "fsdp"), ("2", "fsdp")]
    one, two = json.loads(out_json.read_text())
    assert "error" not in one and "error" not in two, (one, two)
    for row, result in zip(rows, (one, two)):
        assert result["tokens_per_s_per_gpu"] > 0 and result["seconds_per_update"] > 0
        assert number(row["tokens/s/GPU"]) == pytest.approx(result["tokens_per_s_per_gpu"], abs=1)
        assert number(row["tokens/GPU/update"]) == result["tokens_per_gpu_per_update"]
        assert result["grad_norm"] > 0
    efficiency = two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
    assert number(rows[1]["scaling eff."]) == pytest.approx(100 * efficiency, abs=0.1)
    assert rows[0]["scaling eff."] == ""  # the 1-rank run is the baseline
