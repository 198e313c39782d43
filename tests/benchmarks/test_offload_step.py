"""benchmarks/offload_step.py on CPU: GRPO steps of the tiny mixture of experts, full-parameter
with AdamW on the host and LoRA on attention and experts with routing replay, one table row
each, with the memory plan beside the measurement; a setting the plan says does not fit the
host's memory is not run, and its reason is printed."""

from __future__ import annotations

import json

import pytest
from benchmark_run import load_script, markdown_rows, number, run_benchmark


@pytest.mark.slow
def test_a_row_per_setting_and_the_plans_verdict_for_one_that_does_not_fit(tmp_path):
    out_json = tmp_path / "offload.json"
    # 0.02 GiB of free host memory: the full model's fp32 masters and AdamW moments on the
    # host (37.6 MB with the step's data) do not fit; LoRA's adapters (14.9 MB) do
    out = run_benchmark(
        "offload_step.py", "--model", "tiny-moe", "--prompts", "2", "--samples", "2",
        "--prompt-len", "6", "--new-tokens", "5", "--steps", "2", "--micro-tokens", "256",
        "--lora", "4", "--lora-offload", "--lora-override", "model.dtype=float32",
        "--override", "actor.router_replay=rollout", "--host-memory-gib", "0.02",
        "--json", str(out_json),
    )  # fmt: skip
    rows = markdown_rows(out, "| setting |")
    assert [(r["setting"], r["plan"]) for r in rows] == [
        ("full, AdamW on the host", "does not fit"),
        ("LoRA r4, AdamW on the host", "fits"),
    ]
    assert "full, AdamW on the host, the plan's verdict: the run needs at least" in out
    assert "of host memory" in out
    host, lora = json.loads(out_json.read_text())
    assert not host["fits"] and "step_s" not in host  # planned, not run
    row = rows[1]
    assert lora["steps"] == 2 and len(lora["all_steps_s"]) == 2
    assert number(row["s/step"]) == round(lora["step_s"], 2)
    assert number(row["tokens/s/GPU"]) == round(2 * 2 * (6 + 5) / lora["step_s"])
    assert "update_actor" in lora["stage_s"] and "gen" in lora["stage_s"]
    # on the host: the full model's masters and moments; LoRA's adapters' only
    assert 0 < lora["plan_host_gib"] < host["plan_host_gib"]


def test_s_per_step_is_the_median_of_the_steps_after_the_first():
    bench = load_script("offload_step.py")
    stages = {"timing_s/step": 2.0, "timing_s/gen": 1.5, "timing_s/update_actor": 0.5}
    got = bench.step_numbers([9.0, 1.0, 3.0, 2.0], stages, tokens=100)
    assert got["step_s"] == 2.0  # median of 1, 3, 2: the first (9 s, compiling) left out
    assert got["tokens_per_s_per_gpu"] == 50.0
    assert got["stage_s"] == {"gen": 1.5, "update_actor": 0.5}
    assert bench.step_numbers([4.0], stages, tokens=8)["step_s"] == 4.0  # one step: itself
