"""benchmarks/rollout.py on CPU (--quick): the tiny preset's variants, the engine next to HF."""

from __future__ import annotations

import json

import pytest
from benchmark_run import markdown_rows, number, run_benchmark


@pytest.mark.slow
def test_quick_variants_print_a_table_with_the_hf_baseline(tmp_path):
    out = run_benchmark(
        "rollout.py", "--device", "cpu", "--quick", "--only", "variants", "--out", str(tmp_path)
    )
    rows = markdown_rows(out, "| preset |")
    assert [(r["preset"], r["prompts x n"]) for r in rows] == [
        ("tiny", "4 x 1"),
        ("tiny", "2 x 2"),
        ("tiny", "2 x 2"),
    ]
    results = json.loads((tmp_path / "rollout.json").read_text())
    assert (tmp_path / "rollout.md").read_text().strip() == results["table"]
    for row, variant in zip(rows, results["variants"]):
        assert "error" not in variant, variant["error"]
        assert variant["tokens"] == 4 * 8  # 4 samples, 8 new tokens each (--quick)
        assert number(row["tok/s"]) > 0
        assert row["ms/step"] == "-" or number(row["ms/step"]) > 0  # "-": TTFT ran longer
    assert rows[0]["options"] == "decode_backend=torch cuda_graphs=False steps_per_sync=4"
    assert rows[2]["options"].endswith("kv_cache_dtype=fp8")  # the FP8 KV cache
    # The first variant also times HF generate on the same prompts.
    assert number(rows[0]["HF tok/s"]) > 0
    assert number(rows[0]["x HF"]) == pytest.approx(
        results["variants"][0]["speedup_vs_hf"], abs=0.051
    )
