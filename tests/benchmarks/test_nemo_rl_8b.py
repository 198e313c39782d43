"""benchmarks/nemo_rl_8b.py on the CPU: a row per prompt count with tokens/s/GPU by NeMo-RL's
definition, the stages' shares, the flatness line and the published comparison; and the
memory plan's optimizer placement for the 8B recipe on one H200."""

from __future__ import annotations

import json

import pytest
from benchmark_run import load_script, markdown_rows, number, run_benchmark


def test_a_row_per_prompt_count_and_the_comparison_with_nemo_rl(tmp_path):
    out_json = tmp_path / "nemo.json"
    out = run_benchmark(
        "nemo_rl_8b.py", "--model", "tiny", "--prompts", "1", "2", "--samples", "4",
        "--prompt-len", "8", "--sequence-len", "24", "--steps", "2", "--device", "cpu",
        "--json", str(out_json),
    )  # fmt: skip
    rows = markdown_rows(out, "| prompts |")
    results = json.loads(out_json.read_text())
    assert [(r["prompts"], r["sequences"]) for r in rows] == [("1", "4"), ("2", "8")]
    for row, result in zip(rows, results):
        # every response runs to its maximum: 24 tokens per sequence, prompt included
        assert result["tokens_per_step"] == result["sequences"] * 24
        rate = result["tokens_per_step"] / result["step_s"]
        assert number(row["tokens/s/GPU"]) == round(rate)
        assert "gen" in result["stage_s"] and "ref" in result["stage_s"]  # KL to the reference
        assert "update_actor" in row["stages: s (share, floor s)"]
    assert "NeMo-RL's definition" in out and "flatness: tokens/s/GPU from" in out
    assert "NeMo-RL on-policy: 1,581 tokens/s/GPU" in out
    assert "NeMo-RL one step off: 2,478 tokens/s/GPU" in out
    assert "H200" in out and "1 GPU against 16" in out and "random weights" in out


def test_the_recipe_on_one_h200_puts_adamw_on_the_host_as_the_plan_requires():
    bench = load_script("nemo_rl_8b.py")
    h200 = ["--gpu-memory-gib", "141", "--host-memory-gib", "500"]
    assert bench.choose_optimizer(bench.build_parser().parse_args(h200), 8) == (True, [])
    larger = ["--gpu-memory-gib", "400", "--host-memory-gib", "500"]
    assert bench.choose_optimizer(bench.build_parser().parse_args(larger), 8) == (False, [])
    # 512 sequences per optimizer step, as the recipe: 16 prompts of 32
    args = bench.build_parser().parse_args([])
    assert "actor.ppo_mini_batch_size=8" in bench.recipe_overrides(args, 8, True)
    assert "actor.ppo_mini_batch_size=16" in bench.recipe_overrides(args, 64, True)


def test_a_stage_cell_gives_its_share_and_its_floor():
    bench = load_script("nemo_rl_8b.py")
    row = {"step_s": 200.0, "floor_s": {"update_actor": 60.1}}
    assert bench.stage_cell("update_actor", 110.0, row) == "update_actor 110.0 (55%, floor 60.1)"
    assert bench.stage_cell("reward", 2.0, row) == "reward 2.0 (1%)"


def test_stage_floors_at_an_h200s_peaks(monkeypatch):
    bench = load_script("nemo_rl_8b.py")
    monkeypatch.setattr(bench, "device_name", lambda args: "NVIDIA H200")
    args = bench.build_parser().parse_args([])
    floors = bench.stage_floors_s(args, 8, True)
    assert set(floors) == {"gen", "old_logprob", "ref", "update_actor"}
    # the update is 3 forwards (4 with recomputation) of the reference pass's matmuls
    assert floors["update_actor"] in (
        pytest.approx(3 * floors["ref"]),
        pytest.approx(4 * floors["ref"]),
    )
    assert 0 < floors["ref"] < floors["gen"]
