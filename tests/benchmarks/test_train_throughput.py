"""benchmarks/train_throughput.py on CPU: the tiny preset, a few short micro-batches."""

from __future__ import annotations

import json

import pytest
from benchmark_run import markdown_rows, number, run_benchmark


@pytest.mark.slow
def test_prints_ours_and_hf_rows_consistent_with_the_json(tmp_path):
    out_json = tmp_path / "mfu.json"
    out = run_benchmark(
        "train_throughput.py", "--preset", "tiny", "--device", "cpu", "--tokens-per-batch",
        "256", "--min-len", "8", "--max-len", "32", "--warmup", "1", "--steps", "2",
        "--variants", "attention,ours,hf", "--attention-backends", "sdpa_loop",
        "--attention-repeats", "2", "--json", str(out_json),
    )  # fmt: skip
    rows = markdown_rows(out, "| variant |")
    assert [r["variant"] for r in rows] == ["ours packed sdpa_loop", "HF transformers padded sdpa"]
    results = json.loads(out_json.read_text())
    assert results["sections"]["attention"]["sdpa_loop"]["correct"]
    timed = results["micro_batches"][1:]  # the first one is the warm-up
    for row, key in zip(rows, ("ours", "hf")):
        section = results["sections"][key]
        assert section["tokens"] == sum(sum(b) for b in timed)  # real tokens only
        assert number(row["tokens/s"]) == pytest.approx(section["tokens_per_s"], abs=0.5)
        assert section["tokens_per_s"] > 0 and number(row["step s"]) > 0
        assert 0 < section["mfu_no_lm_head"] < section["mfu"] < 1
    assert 0 < results["sections"]["hf"]["padding_fraction"] < 1


@pytest.mark.slow
def test_the_chunked_head_is_named_in_its_row():
    out = run_benchmark(
        "train_throughput.py", "--preset", "tiny", "--device", "cpu", "--tokens-per-batch",
        "128", "--min-len", "8", "--max-len", "16", "--warmup", "1", "--steps", "1",
        "--variants", "ours", "--attention-backends", "sdpa_loop", "--head", "chunked",
    )  # fmt: skip
    rows = markdown_rows(out, "| variant |")
    assert [r["variant"] for r in rows] == ["ours packed sdpa_loop chunked head"]
