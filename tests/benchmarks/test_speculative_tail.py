"""benchmarks/speculative_tail.py on CPU (the tiny preset, budgets of seconds): the SFT warm
start on GSM8K-like rows, the generation phase with speculation off and on, and GRPO runs
whose steps log the speculation and tail metrics; a given checkpoint skips the SFT, and a
phase with no time left is skipped with what the others measured kept. Its tables' arithmetic."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from benchmark_run import REPO, load_script, markdown_rows, run_benchmark

SMALL = ["--preset", "tiny", "--device", "cpu", "--tokenizer-vocab", "512",
         "--gen-prompts", "2", "--gen-samples", "2", "--gen-max-new-tokens", "24",
         "--gen-repeats", "1", "--gen-engine", "speculative_min_ngram=1",
         "--gen-engine", "speculative_rule=always",
         "--rl-prompts", "2", "--rl-samples", "2", "--rl-max-new-tokens", "24", "--rl-steps", "2",
         "--rl-warmup", "0", "--rl-override", "rollout.engine.speculative_min_ngram=1",
         "--rl-override", "rollout.engine.speculative_rule=always",
         "--rl-reserve-s", "0", "--rl-min-s", "5"]  # fmt: skip
# speculative_rule=always: on a CPU a tiny model's verify pass does not pay, so the measured
# rule (the default) would turn it off before these runs' few tail steps re-probe it; the test
# is of the benchmark's phases and metrics, not of the rule (tests/engine/speculative/test_rule.py)


def _gsm8k_file(path, rows=24):
    """GSM8K's layout and its calculator annotations: the repeats n-gram drafts find."""
    with path.open("w") as f:
        for i in range(rows):
            a, b = i + 3, 2 * i + 1
            question = f"Ann has {a} apples and buys {b} more. How many apples does Ann have?"
            answer = (f"Ann buys {b} apples, so she has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} "
                      f"apples.\n#### {a + b}")  # fmt: skip
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    return path


def _step_metrics(work, mode: str) -> list[dict]:
    rows = (work / f"run-{mode}" / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, rows) if "timing_s/step" in row]


STEP_METRICS = {"rollout/speculative_acceptance_rate", "rollout/speculative_tokens_per_pass",
                "rollout/tail_seconds"}  # fmt: skip


@pytest.mark.slow
def test_the_warm_start_generation_and_a_grpo_run_are_measured_with_and_without(tmp_path):
    out = tmp_path / "result.json"
    text = run_benchmark(
        "speculative_tail.py", "--input", str(_gsm8k_file(tmp_path / "train.jsonl")), *SMALL,
        "--sft-seconds", "3", "--sft-batch", "8", "--sft-lr", "3e-3", "--rl-modes", "sync:spec",
        "--work-dir", str(tmp_path / "work"), "--json", str(out), timeout=420,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["errors"] == {}
    assert result["sft"]["steps"] >= 1 and result["sft"]["final_loss"] > 0
    hf = tmp_path / "work" / "sft" / "hf"
    assert (hf / "config.json").exists() and (hf / "tokenizer.json").exists()
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == 2  # <|im_end|>
    generation = result["generation"]
    assert [c["warmup"] for c in generation["off"]] == [True, False]
    assert [c["seed"] for c in generation["ngram"]] == [0, 1]  # the same seeds as off
    on = generation["ngram"][1]
    assert on["rollout/speculative_passes"] > 0 and 0 < on["tail_s"] <= on["seconds"]
    assert "rollout/speculative_tokens_per_pass" in on
    rows = markdown_rows(text, "| speculation |")
    assert [row["speculation"] for row in rows] == ["off", "ngram"]
    assert "tail " in text and "× faster (target 1.5×)" in text
    # every step logs the acceptance, tokens per pass and tail seconds
    assert [r["mode"] for r in result["rl"]] == ["sync:spec"]
    steps = _step_metrics(tmp_path / "work", "sync-spec")
    assert len(steps) == 2 and all(STEP_METRICS <= set(row) for row in steps)
    assert [row["mode"] for row in markdown_rows(text, "| mode |")] == ["sync:spec"]


@pytest.mark.slow
def test_a_given_checkpoint_skips_the_sft_and_a_phase_with_no_time_keeps_the_others(tmp_path):
    bench = load_script("gsm8k_step.py")
    train = _gsm8k_file(tmp_path / "train.jsonl")
    checkpoint = tmp_path / "checkpoint"
    tokenizer = bench.build_tokenizer([json.loads(line)["question"] for line in open(train)],
                                      512, checkpoint)  # fmt: skip
    bench.build_model_dir("tiny", len(tokenizer), tokenizer, checkpoint)
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "speculative_tail.py"), "--input", str(train),
         *SMALL, "--model-dir", str(checkpoint), "--gen-seconds", "5",
         "--rl-modes", "async:1:partial:spec",
         "--work-dir", str(tmp_path / "work"), "--json", str(out)],
        cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "== sft" not in done.stdout
    assert "phases that failed or were skipped: generation" in done.stdout
    result = json.loads(out.read_text())
    assert "sft" not in result and "generation" not in result
    assert result["errors"] == {"generation": "skipped: 5 s left of --budget-s for it"}
    assert [r["mode"] for r in result["rl"]] == ["async:1:partial:spec"]  # measured still
    steps = _step_metrics(tmp_path / "work", "async-1-partial-spec")
    assert len(steps) == 2 and all(STEP_METRICS <= set(row) for row in steps)


def test_a_bad_row_or_setting_stops_it_before_anything_runs(tmp_path):
    bench = load_script("speculative_tail.py")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    for args, message in (
        (["--input", str(bad)], "line 1: a GSM8K row needs 'question' and an 'answer' ending"),
        (["--input", str(bad), "--gen-engine", "speculative_draft_tokens=0"],
         "--gen-engine: invalid engine options"),
        (["--input", str(bad), "--rl-override", "actor.bogus=1"], "unknown key actor.bogus"),
        (["--input", str(bad), "--rl-modes", "sync:fast"], "--modes: 'sync:fast' is not"),
        (["--input", str(bad), "--model-dir", str(tmp_path)], "no such checkpoint directory"),
        (["--input", str(tmp_path / "none.jsonl")], "no such file"),
    ):  # fmt: skip
        with pytest.raises(SystemExit, match=re.escape(message)):
            bench.main([*args, "--work-dir", str(tmp_path / "work")])
    assert not (tmp_path / "work" / "sft.jsonl").exists()  # nothing ran


def test_the_tables_compare_each_speculative_mode_with_its_baseline(capsys):
    report = load_script("speculative_report.py")
    calls = lambda seconds, tail, digests, **spec: [  # noqa: E731
        {"warmup": True, "seed": 0, "seconds": 9.0, "tail_s": 9.0, "tokens_per_s": 1.0,
         "response_mean": 1.0, "response_max": 1, "cut": 0, "digests": []},
        {"warmup": False, "seed": 1, "seconds": seconds, "tail_s": tail, "tokens_per_s": 100.0,
         "response_mean": 50.0, "response_max": 400, "cut": 1, "digests": digests, **spec}]  # fmt: skip
    spec = {"rollout/speculative_passes": 40.0, "rollout/speculative_acceptance_rate": 0.5,
            "rollout/speculative_tokens_per_pass": 2.5,
            "rollout/speculative_tail_seconds_saved": 1.5}  # fmt: skip
    report.print_generation({"device": "cpu", "prompts": 2, "samples": 2, "temperature": 1.0,
                             "max_new_tokens": 400, "tail_rows": 16,
                             "off": calls(4.0, 3.0, ["a", "b"]),
                             "ngram": calls(2.5, 1.5, ["a", "c"], **spec)})  # fmt: skip
    text = capsys.readouterr().out
    rows = markdown_rows(text, "| speculation |")
    assert rows[0]["tail s"] == "3.00" and rows[0]["before the tail s"] == "1.00"
    assert rows[1]["accepted"] == "50.0%" and rows[1]["saved s (est.)"] == "1.50"
    assert "tail 2.00× faster (target 1.5×), the whole call 1.60×; 1 of 2 completions" in text
    run = lambda mode, step: {"mode": mode, "complete": True, "step_s": step, "gen_s": 1.0,  # noqa: E731
                              "steps_s": [step], "response_mean": 9.0, "response_max": 30.0,
                              "async_metrics": {}}  # fmt: skip
    report.print_rl([run("sync", 6.0), run("sync:spec", 5.0), run("async:1:partial:spec", 4.0)],
                    1)  # fmt: skip
    text = capsys.readouterr().out
    speedups = [row["speed-up"] for row in markdown_rows(text, "| mode |")]
    assert speedups == ["-", "1.20×", "-"]  # no async:1:partial run to compare with
    assert "sync step 1.20× faster with speculation (target 1.2×)" in text


def test_the_measured_prompts_are_held_out_of_the_sft():
    bench = load_script("speculative_tail.py")
    rows = [{"question": f"q{i}"} for i in range(10)]
    sft, gen, rl = bench.split_rows(rows, 2, 3)
    assert [r["question"] for r in sft] == [f"q{i}" for i in range(5)]
    assert [r["question"] for r in gen] == ["q5", "q6"]
    assert [r["question"] for r in rl] == ["q7", "q8", "q9"]
    with pytest.raises(SystemExit, match="10 rows, and 4 .* 6 .* are held out"):
        bench.split_rows(rows, 4, 6)
