"""benchmarks/async_rl.py on CPU: sync and async (staleness 1) runs of the long-tail workload
through `hybridflow train`, with the table it prints; the lengths really are long-tailed (some
responses end early, some run to the cap), and the async run logged its staleness."""

from __future__ import annotations

import json
import sys

import pytest
from benchmark_run import REPO, markdown_rows, run_benchmark

sys.path.insert(0, str(REPO / "benchmarks"))
from async_rl import mode_overrides, uneven_warning  # noqa: E402


@pytest.mark.slow
def test_sync_and_async_runs_of_the_long_tail_workload_print_their_table(tmp_path):
    out = tmp_path / "result.json"
    text = run_benchmark(
        "async_rl.py", "--preset", "tiny", "--device", "cpu", "--prompts", "4", "--samples",
        "2", "--prompt-len", "8", "--max-new-tokens", "32", "--mean-new-tokens", "8",
        "--steps", "3", "--warmup", "1", "--modes", "sync", "async:1", "async:1:partial",
        "--prime", "1", "--work-dir", str(tmp_path / "work"), "--json", str(out),
    )  # fmt: skip
    assert "priming the compile caches: 1 step(s) of sync" in text
    assert "  prime step 1: " in text  # a run of its own, not one of the table's
    rows = markdown_rows(text, "| mode |")
    assert [row["mode"] for row in rows] == ["sync", "async:1", "async:1:partial"]
    assert {row["GPU busy %"] for row in rows} == {"-"}  # no GPU here: not sampled
    results = json.loads(out.read_text())
    for result in results:
        assert len(result["steps_s"]) == 3 and result["step_s"] > 0
        assert 0 < result["response_mean"] < result["response_max"] <= 32  # lengths spread
        # the mean leaves out the warm-up and the last step (an async run's overlaps nothing)
        assert result["step_s"] == pytest.approx(result["steps_s"][1])
    assert results[1]["async_metrics"]["async/staleness"] == 1.0
    assert results[2]["async_metrics"]["async/staleness_max"] <= 1.0


@pytest.mark.slow
def test_a_run_stopped_at_its_timeout_reports_the_steps_it_finished_and_its_last_lines(tmp_path):
    """A mode that outlives --run-timeout is stopped (no traceback): its finished steps are
    its result, marked as stopped, and the run's last log lines say where it was."""
    out = tmp_path / "result.json"
    text = run_benchmark(
        "async_rl.py", "--preset", "tiny", "--device", "cpu", "--prompts", "4", "--samples",
        "2", "--prompt-len", "8", "--max-new-tokens", "32", "--mean-new-tokens", "8",
        "--steps", "100000", "--warmup", "1", "--modes", "sync", "--run-timeout", "15",
        "--work-dir", str(tmp_path / "work"), "--json", str(out),
    )  # fmt: skip
    assert "sync: stopped after its time limit of 15 s" in text
    assert "Traceback" not in text
    assert "  sync step 1: " in text  # steps printed as they landed
    rows = markdown_rows(text, "| mode |")
    assert [row["mode"] for row in rows] == ["sync (stopped at --run-timeout)"]
    (result,) = json.loads(out.read_text())
    assert not result["complete"] and 0 < len(result["steps_s"]) < 100000


def test_a_mode_names_its_staleness_partial_rollouts_and_the_services_stream():
    assert mode_overrides("sync") == ["trainer.mode=sync"]
    assert mode_overrides("async:2") == [
        "trainer.mode=async",
        "trainer.max_staleness=2",
        "trainer.partial_rollout=false",
    ]
    assert mode_overrides("async:1:partial:priority") == [
        "trainer.mode=async", "trainer.max_staleness=1", "trainer.partial_rollout=true",
        "rollout.engine.service_stream=priority"]  # fmt: skip
    assert mode_overrides("async:1:partial:split")[-2:] == [
        "trainer.placement=split", "trainer.rollout_gpus=1"]  # fmt: skip
    assert mode_overrides("sync:spec") == ["trainer.mode=sync",
                                           "rollout.engine.speculative=ngram"]  # fmt: skip
    assert mode_overrides("async:1:partial:spec")[-1] == "rollout.engine.speculative=ngram"
    for bad in ("async:1:fast", "async:1:partial:partial", "async:x", "sync:1", "async",
                "sync:spec:spec"):  # fmt: skip
        with pytest.raises(SystemExit, match="async:S"):
            mode_overrides(bad)


def test_timed_steps_far_apart_are_flagged_as_no_steady_state():
    # a one-step prime left sync's second step to compile again (44.3 s beside 23.3 s)
    warning = uneven_warning("sync", [44.30, 23.30])
    assert warning.startswith("warning: sync's timed steps differ 1.9×") and "--prime 2" in warning
    assert uneven_warning("async:1:partial", [23.14, 22.12]) is None  # run-to-run noise
    assert uneven_warning("sync", [22.4]) is None  # one timed step: nothing to compare


def test_a_given_checkpoint_and_prompts_replace_the_random_ones(tmp_path):
    from argparse import Namespace

    from async_rl import prepare_workload, workload_paths

    work, checkpoint = tmp_path / "work", tmp_path / "ckpt"
    work.mkdir()
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"vocab_size": 300}))
    args = Namespace(model_dir=str(checkpoint), tokenizer_dir=None, prompts_file=None,
                     prompts=3, prompt_len=4, preset="tiny", mean_new_tokens=8)  # fmt: skip
    prepare_workload(work, args)
    assert not (work / "model").exists()  # no random-weight model built
    rows = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and (work / "reward.py").exists()
    words = rows[0]["prompt"][0]["content"].split()
    assert len(words) == 4 and all(10 <= int(w[1:]) < 150 for w in words)  # the model's vocab
    assert workload_paths(work, args) == {"model": checkpoint, "tokenizer": checkpoint,
                                          "prompts": work / "prompts.jsonl"}  # fmt: skip
    given = Namespace(model_dir=None, tokenizer_dir=None, prompts_file=str(tmp_path / "p.jsonl"))
    assert workload_paths(work, given) == {"model": work / "model",
                                           "tokenizer": work / "tokenizer",
                                           "prompts": tmp_path / "p.jsonl"}  # fmt: skip
