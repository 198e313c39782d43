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
        "--prompt-len", "8", "--sequence-len", "24", "--warmup-steps", "1",
        "--warmup-sequence-len", "16", "--device", "cpu", "--json", str(out_json),
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
    assert "after a warm-up run of 1 step(s) at 16 tokens per sequence" in out
    assert "timed run (its build and steps): 1 prompts: 0 torch.compile graphs traced" in out
    assert all(r["compiled_in_timed_run"] == {"compiled_graphs": 0, "engine_choices": 0}
               for r in results)  # fmt: skip
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


def test_the_kv_cache_takes_the_memory_free_during_generation():
    """0.4 of the free memory holds 74 of the 256 full-length sequences on one H200; the
    default (auto: 0.9 here) holds 177 (the generation peak still fits the usable memory, beside
    the workspaces of prefill, sampling and the experts the engine reserves)."""
    bench = load_script("nemo_rl_8b.py")
    h200 = ["--gpu-memory-gib", "141", "--host-memory-gib", "500"]
    args = bench.build_parser().parse_args(h200)
    assert bench.kv_sequences(args, 8, True) == 177
    assert bench.choose_optimizer(args, 8) == (True, [])
    config_default = bench.build_parser().parse_args(
        [*h200, "--override", "rollout.gpu_memory_utilization=0.4"]
    )
    assert bench.kv_sequences(config_default, 8, True) == 74
    assert bench.kv_sequences(bench.build_parser().parse_args(["--device", "cpu"]), 8, True) is None


def test_the_warm_up_runs_first_at_its_length_with_the_timed_runs_memory_choices(monkeypatch):
    bench = load_script("nemo_rl_8b.py")
    args = bench.build_parser().parse_args(
        ["--gpu-memory-gib", "141", "--host-memory-gib", "500", "--warmup-steps", "1"]
    )
    runs = []

    def grpo_steps(run_args, prompts, offload, steps, overrides=()):
        runs.append((run_args.sequence_len, prompts, offload, steps, overrides))
        return [100.0], [90.0], {"timing_s/gen": 60.0, "timing_s/update_actor": 40.0}

    monkeypatch.setattr(bench, "grpo_steps", grpo_steps)
    monkeypatch.setattr(bench, "stage_floors_s", lambda args, prompts, offload: {})
    row = bench.run_prompts(args, 8)
    (warm_len, *warm, warm_overrides), timed = runs
    assert (warm_len, *warm) == (512, 8, True, 1) and timed == (4096, 8, True, 1, ())
    # the graphs the warm-up compiles are the timed run's: checkpointing and budgets pinned
    assert "model.gradient_checkpointing=true" in warm_overrides
    assert "actor.max_tokens_per_gpu=65536" in warm_overrides
    assert row["step_s"] == 100.0 and row["tokens_per_step"] == 256 * 4096
    assert row["kv_sequences"] == 177


def test_compile_activity_counts_the_engines_pinned_choices(tmp_path):
    bench = load_script("nemo_rl_8b.py")
    args = bench.build_parser().parse_args(["--override", f"trainer.cache_dir={tmp_path}"])
    assert bench.compile_activity(args)["engine_choices"] == 0
    folder = tmp_path / "engine-choices"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps({"identity": {}, "choices": {"x": 1, "y": 2}}))
    (folder / "b.json").write_text("{half written")
    assert bench.compile_activity(args)["engine_choices"] == 2


def test_a_stage_cell_gives_its_share_and_its_floor():
    bench = load_script("nemo_rl_8b.py")
    row = {"step_s": 200.0, "floor_s": {"update_actor": 60.1}}
    assert bench.stage_cell("update_actor", 110.0, row) == "update_actor 110.0 (55%, floor 60.1)"
    assert bench.stage_cell("reward", 2.0, row) == "reward 2.0 (1%)"


def test_stage_floors_at_an_h200s_peaks(monkeypatch):
    bench = load_script("nemo_rl_8b.py")
    monkeypatch.setattr(bench, "device_name", lambda args: "NVIDIA H200")
    args = bench.build_parser().parse_args(["--gpu-memory-gib", "141"])
    floors = bench.stage_floors_s(args, 8, True)
    assert set(floors) == {"gen", "old_logprob", "ref", "update_actor"}
    # the update is 3 forwards (4 with recomputation) of the reference pass's matmuls
    assert floors["update_actor"] in (
        pytest.approx(3 * floors["ref"]),
        pytest.approx(4 * floors["ref"]),
    )
    assert 0 < floors["ref"] < floors["gen"]


def test_the_generation_floor_counts_the_decode_steps_the_kv_cache_forces(monkeypatch):
    bench = load_script("nemo_rl_8b.py")
    monkeypatch.setattr(bench, "device_name", lambda args: "NVIDIA H200")
    h200 = ["--gpu-memory-gib", "141"]
    holds_178 = bench.stage_floors_s(bench.build_parser().parse_args(h200), 8, True)
    unknown_gpu = bench.stage_floors_s(bench.build_parser().parse_args([]), 8, True)
    holds_76 = bench.stage_floors_s(bench.build_parser().parse_args(
        [*h200, "--override", "rollout.gpu_memory_utilization=0.4"]), 8, True)  # fmt: skip
    # 178 sequences of 4,096 hold every row's tokens at every step: no extra decode step
    assert holds_178["gen"] == pytest.approx(unknown_gpu["gen"])
    assert holds_76["gen"] > holds_178["gen"] + 5  # 2,265 more weight reads of 16 GB
    assert holds_76["ref"] == holds_178["ref"]
