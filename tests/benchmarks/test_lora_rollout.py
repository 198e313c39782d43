"""benchmarks/lora_rollout.py on CPU: the unmerged adapters and the merged copy, a row each."""

from __future__ import annotations

import json

import pytest
from benchmark_run import markdown_rows, run_benchmark


@pytest.mark.slow
def test_prints_unmerged_and_merged_rows(tmp_path):
    out_json = tmp_path / "lora.json"
    out = run_benchmark("lora_rollout.py", "--preset", "tiny", "--device", "cpu", "--prompts",
                        "3", "--prompt-len", "5", "--new-tokens", "6", "--rank", "4",
                        "--repeats", "1", "--json", str(out_json))  # fmt: skip
    rows = markdown_rows(out, "| rollout |")
    assert [r["rollout"] for r in rows] == ["adapters unmerged (lora_in_place)", "merged copy"]
    unmerged, merged = json.loads(out_json.read_text())
    assert unmerged["weights_gib"] == 0 and merged["weights_gib"] > 0
    assert unmerged["tokens_per_s"] > 0 and merged["tokens_per_s"] > 0
