"""benchmarks/gsm8k_step.py on CPU: examples/gsm8k.yaml through `hybridflow train` on a random
model with a BPE tokenizer trained on the questions, the stages of its steps and its table."""

from __future__ import annotations

import json

import pytest
from benchmark_run import markdown_rows, number, run_benchmark


def _gsm8k_file(path):
    with path.open("w") as f:
        for i in range(24):
            question = (f"Ann has {i + 3} apples and buys {2 * i + 1} more at the market. "
                        f"How many apples does Ann have now?")  # fmt: skip
            f.write(json.dumps({"question": question, "answer": f"She has {3 * i + 4}.\n#### "
                                f"{3 * i + 4}"}) + "\n")  # fmt: skip
    return path


@pytest.mark.slow
def test_the_example_runs_and_its_stages_are_printed(tmp_path):
    out = tmp_path / "result.json"
    text = run_benchmark(
        "gsm8k_step.py", "--input", str(_gsm8k_file(tmp_path / "train.jsonl")),
        "--preset", "tiny", "--vocab", "512", "--device", "cpu", "--steps", "2",
        "--override", "data.train_batch_size=4", "--override", "actor.ppo_mini_batch_size=2",
        "--override", "rollout.n=2", "--override", "data.max_response_length=8",
        "--work-dir", str(tmp_path / "work"), "--json", str(out),
    )  # fmt: skip
    assert "  gsm8k step 2: " in text
    (row,) = markdown_rows(text, "| step s |")
    result = json.loads(out.read_text())
    assert result["complete"] and len(result["steps_s"]) == 2 and result["timed_steps"] == 1
    # the example's KL loss needs the reference pass; two mini-batches the old log-probs
    for stage in ("gen", "old_logprob", "ref", "update_actor"):
        assert result["stages_s"][stage] > 0 and number(row[f"{stage} s"]) >= 0
    assert number(row["step s"]) == round(result["steps_s"][1], 2)
    assert result["response_mean"] == 8  # random weights: every response runs to the cap
    template = (tmp_path / "work" / "tokenizer" / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template


def test_the_floors_follow_the_run_shape_and_its_checkpointing(monkeypatch):
    """On an H200 (faked: the floors are arithmetic), each stage's floor at the run's mean
    lengths; the example's update fits without recomputing, so it is 3 forwards, not 4."""
    import torch
    from benchmark_run import load_script

    bench = load_script("gsm8k_step.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    overrides = ["--config", str(bench.REPO / "examples" / "gsm8k.yaml"),
                 "model.path=qwen2.5-0.5b", "trainer.gpu_memory_gib=141"]  # fmt: skip
    floors = bench.stage_floors_for(overrides, {"prompt_mean": 120.0, "response_mean": 512.0},
                                    "qwen2.5-0.5b")  # fmt: skip
    assert set(floors) == {"gen", "old_logprob", "ref", "update_actor"}
    assert floors["update_actor"] == 3 * floors["ref"] and floors["ref"] == floors["old_logprob"]
    assert floors["gen"] > 0
    # the lengths are the run's: longer responses, a longer floor for every stage
    longer = bench.stage_floors_for(overrides, {"prompt_mean": 120.0, "response_mean": 1024.0},
                                    "qwen2.5-0.5b")  # fmt: skip
    assert all(longer[k] > floors[k] for k in floors)
