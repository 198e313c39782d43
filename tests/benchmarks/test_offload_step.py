"""benchmarks/offload_step.py on CPU: the tiny preset's GRPO steps with AdamW on the host,
on the device, and LoRA, one table row each, with the memory plan beside the measurement."""

from __future__ import annotations

import json

from benchmark_run import markdown_rows, number, run_benchmark


def test_prints_a_row_per_optimizer_placement_with_the_plan(tmp_path):
    out_json = tmp_path / "offload.json"
    out = run_benchmark(
        "offload_step.py", "--model", "tiny", "--prompts", "2", "--samples", "2",
        "--prompt-len", "6", "--new-tokens", "5", "--steps", "2", "--micro-tokens", "256",
        "--compare", "--lora", "4", "--json", str(out_json),
    )  # fmt: skip
    rows = markdown_rows(out, "| setting |")
    assert [r["setting"] for r in rows] == [
        "full, AdamW on the host",
        "full, AdamW on the GPU",
        "LoRA r4, AdamW on the GPU",
    ]
    host, device, lora = json.loads(out_json.read_text())
    for row, result in zip(rows, (host, device, lora)):
        assert result["steps"] == 2 and len(result["all_steps_s"]) == 2
        assert number(row["s/step"]) == round(result["step_s"], 2)
    # the plan moves the masters and AdamW state to the host
    assert host["plan_host_gib"] > device["plan_host_gib"]
    assert host["plan_peak_gib"] < device["plan_peak_gib"]
    # LoRA trains adapters only: its gradients and AdamW state are a fraction of full training's
    assert lora["plan_peak_gib"] < device["plan_peak_gib"]
