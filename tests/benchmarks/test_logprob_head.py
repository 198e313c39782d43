"""benchmarks/logprob_head.py on the CPU: a row per head with its times and its gaps to the
fp64 reference, which are float32 rounding on the CPU."""

from __future__ import annotations

import json

from benchmark_run import markdown_rows, run_benchmark


def test_a_row_per_head_with_times_and_gaps(tmp_path):
    out_json = tmp_path / "head.json"
    out = run_benchmark(
        "logprob_head.py", "--device", "cpu", "--presets", "tiny", "--tokens", "48",
        "--check-tokens", "16", "--repeats", "1", "--warmup", "1", "--json", str(out_json),
    )  # fmt: skip
    rows = markdown_rows(out, "| preset |")
    assert [(r["preset"], r["head"]) for r in rows] == [("tiny", "fused"), ("tiny", "chunked")]
    for result in json.loads(out_json.read_text()):
        assert result["forward"]["ms"] > 0 and result["fwd+bwd"]["ms"] > 0
        assert result["logprob_gap"] < 1e-4 and result["entropy_gap"] < 1e-4
        assert result["grad_hidden_rel"] < 1e-4
