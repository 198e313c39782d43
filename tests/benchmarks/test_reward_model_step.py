"""benchmarks/reward_model_step.py on CPU: tiny GRPO steps scored on the host and by a tiny
reward model (on the device, and offloaded), one table row each, with the plan beside it."""

from __future__ import annotations

import json

import pytest
from benchmark_run import markdown_rows, number, run_benchmark


@pytest.mark.slow  # three settings of two tiny steps in a subprocess
def test_a_row_per_setting_with_the_reward_stage_and_the_plan(tmp_path):
    out_json = tmp_path / "rm.json"
    out = run_benchmark(
        "reward_model_step.py", "--device", "cpu", "--model", "tiny", "--reward-model", "tiny",
        "--prompts", "2", "--samples", "2", "--prompt-len", "6", "--new-tokens", "5",
        "--steps", "2", "--micro-tokens", "256", "--reward-tokens", "64",
        "--gpu-memory-gib", "1", "--json", str(out_json),
    )  # fmt: skip
    rows = markdown_rows(out, "| setting |")
    assert [r["setting"] for r in rows] == ["rule", "reward model", "reward model, offloaded"]
    rule, model, offloaded = json.loads(out_json.read_text())
    assert all(len(r["all_steps_s"]) == 2 and "reward" in r["stage_s"] for r in (rule, model))
    assert number(rows[1]["s/step"]) == round(model["step_s"], 2)
    assert rows[0]["vs rule"] == "1.00x"
    # the plan counts the reward model's weights on the GPU, and not when offloaded
    assert model["plan_peak_gib"] > rule["plan_peak_gib"]
    assert offloaded["plan_peak_gib"] < model["plan_peak_gib"]
