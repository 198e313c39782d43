"""benchmarks/long_sequence_train.py: the memory plan's choices it trains with (gradient
checkpointing, the log-prob token budget) for the 7b's 16k-token workload on an H200-sized GPU,
full-parameter with AdamW on the host and with LoRA; and a CPU smoke run of the tiny preset
that prints its table with the old-log-prob pass batched by the plan's budget."""

from __future__ import annotations

import json

import pytest
from benchmark_run import load_script, markdown_rows, number, run_benchmark

bench = load_script("long_sequence_train.py")
H200_GIB = "141"


def planned(*argv: str) -> dict:
    return bench.planned_run(bench.build_parser().parse_args(list(argv)))


def test_full_parameter_7b_at_16k_tokens_trains_without_checkpointing_on_an_h200():
    plan = planned("--gpu-memory-gib", H200_GIB)
    # AdamW and the fp32 masters on the host leave room for 16,384 tokens' activations without
    # checkpointing (the plan: 116.9 GiB for the update, under 90% of the 132.9 GiB usable)
    assert plan["gradient_checkpointing"] is False
    assert plan["update_tokens"] == 1024 + 15360  # one whole sequence per micro-batch
    assert plan["log_prob_tokens"] == 4 * 16384  # the forward's cap: 4x the update's budget
    assert plan["choices"] == [
        "model.gradient_checkpointing=false",
        "actor.log_prob_max_tokens_per_gpu=65536",
    ]
    assert plan["plan_phase"] == "actor update" and 100 < plan["plan_peak_gib"] < 132.9


def test_lora_keeps_the_masters_on_the_gpu_so_the_plan_turns_checkpointing_on():
    plan = planned("--gpu-memory-gib", H200_GIB, "--lora", "64")
    # no offload with LoRA: fp32 masters and the bf16 copy stay on the GPU, and the update
    # without checkpointing (143 GiB planned) no longer fits under the limit
    assert plan["gradient_checkpointing"] is True
    assert "model.gradient_checkpointing=true" in plan["choices"]
    assert plan["plan_peak_gib"] < 132.9


def test_without_a_gpu_size_nothing_is_planned():
    plan = planned("--device", "cpu", "--preset", "tiny", "--prompt-len", "8", "--new-tokens", "8")
    assert plan["gradient_checkpointing"] is False  # auto resolves to off, as on a CPU run
    assert plan["log_prob_tokens"] is None and plan["plan_peak_gib"] is None


@pytest.mark.slow
def test_cpu_smoke_run_prints_the_plan_choices_and_step_times(tmp_path):
    out_json = tmp_path / "long.json"
    text = run_benchmark(
        "long_sequence_train.py", "--preset", "tiny", "--device", "cpu", "--gpu-memory-gib", "1",
        "--prompt-len", "16", "--new-tokens", "112", "--micro-tokens", "128", "--steps", "2",
        "--json", str(out_json),
    )  # fmt: skip
    assert "model.gradient_checkpointing=auto: on" in text  # 1 GiB: nothing is left for it
    (row,) = markdown_rows(text, "| setting |")
    (result,) = json.loads(out_json.read_text())
    assert row["checkpointing"] == "on" and row["peak allocated GiB"] == "-"  # no GPU
    assert result["steps"] == 2 and result["tokens_per_step"] == 2 * 4 * 128
    assert result["tokens_per_s"] * result["step_s"] == pytest.approx(result["tokens_per_step"])
    assert number(row["s/step"]) == round(result["all_steps_s"][1], 2)  # the first left out
    assert row["old log-prob s"] != "-" and number(row["update s"]) > 0
    # each step said it ended, with its stages, as it ended (a cut-short run shows how far)
    for step in (1, 2):
        (line,) = [x for x in text.splitlines() if x.startswith(f"step {step}: ")]
        assert "gen " in line and "update_actor " in line
