"""benchmarks/fp8_rollout_accuracy.py: the within-noise rule on hand-computed accuracies, the
`hybridflow train` command lines of each (mode, seed) run, the report's verdict, and a CPU
smoke run of one bf16 run through the CLI whose importance-weight metrics are read back."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from benchmark_run import REPO, load_script, markdown_rows, number, run_benchmark

bench = load_script("fp8_rollout_accuracy.py")
BASE = [0.40, 0.42, 0.44]  # mean 0.42, sample std 0.02


def test_a_shift_of_half_a_std_is_within_noise_and_five_stds_is_not():
    near = bench.within_noise(BASE, [0.41, 0.43, 0.45])
    # pooled variance (0.0008 + 0.0008) / (3 + 3 - 2) = 0.0004: std 0.02;
    # standard error 0.02 * sqrt(1/3 + 1/3) = 0.01633; the limit 2 x that = 0.0327
    assert near["diff"] == pytest.approx(0.01)
    assert near["stderr"] == pytest.approx(0.02 * math.sqrt(2 / 3))
    assert near["within"] is True
    far = bench.within_noise(BASE, [0.50, 0.52, 0.54])
    assert far["diff"] == pytest.approx(0.10) and far["within"] is False
    lone = bench.within_noise([0.4], [0.5])  # no degrees of freedom: no verdict
    assert lone["stderr"] is None and lone["within"] is None


def test_mode_summary_is_the_mean_and_sample_std_per_mode():
    runs = [{"mode": "bf16", "final": x} for x in BASE] + [{"mode": "fp8", "final": 0.5}]
    summary = bench.mode_summary(runs)
    assert summary["bf16"]["mean"] == pytest.approx(0.42)
    assert summary["bf16"]["std"] == pytest.approx(0.02)
    assert summary["fp8"]["std"] is None


def synthetic_runs(fp8_finals: list[float]) -> list[dict]:
    def run(mode, seed, final):
        metrics = {"actor/rollout_is/mean": 0.98} if mode == "fp8" else {}
        return {"mode": mode, "seed": seed, "rollout_dtype": "model" if mode == "bf16" else "fp8",
                "correction": "none" if mode == "bf16" else "TIS, cap 2", "initial": 0.3,
                "final": final, "correction_metrics": metrics}  # fmt: skip

    bf16 = [run("bf16", seed, x) for seed, x in zip((1, 2, 3), BASE)]
    return bf16 + [run("fp8", seed, x) for seed, x in zip((1, 2, 3), fp8_finals)]


def test_report_shows_each_run_the_mode_means_and_the_verdict():
    text = bench.report(synthetic_runs([0.41, 0.43, 0.45]), "val/arithmetic/mean@4")
    runs = markdown_rows(text, "| mode | seed |")
    assert [(r["mode"], r["seed"]) for r in runs][2:4] == [("bf16", "3"), ("fp8", "1")]
    assert runs[3]["correction"] == "TIS, cap 2"
    assert runs[3]["IS metrics (mean)"] == "actor/rollout_is/mean=0.98"
    means = markdown_rows(text, "| mode | seeds |")
    assert [number(r["final mean"]) for r in means] == [0.42, 0.43]
    assert "fp8 - bf16 final mean: +0.010, standard error 0.016: within noise" in text
    far = bench.report(synthetic_runs([0.50, 0.52, 0.54]), "val/arithmetic/mean@4")
    assert "NOT within noise" in far


def test_each_run_is_a_train_process_of_the_grpo_example_with_its_seed_and_the_shared_cache():
    args = Namespace(steps=7, device=None, override=["actor.lr=1e-5"])
    work = Path("/w")
    fp8 = bench.run_overrides("fp8", 2, work, args)
    bf16 = bench.run_overrides("bf16", 2, work, args)
    assert fp8[0] == "rollout.dtype=fp8" and bf16[0] == "rollout.dtype=model"
    assert "trainer.seed=2" in fp8 and "trainer.total_steps=7" in fp8
    assert "trainer.cache_dir=/w/cache" in fp8 and "trainer.cache_dir=/w/cache" in bf16
    assert "trainer.run_dir=/w/run-fp8-seed2" in fp8
    assert fp8[-1] == "actor.lr=1e-5"  # the user's overrides last: they win
    command = bench.train_args(fp8)
    assert command[:2] == ["--config", str(REPO / "examples" / "grpo.yaml")]
    assert command[2:] == fp8  # the overrides after the example: they win


def test_fp8_on_the_cpu_is_refused_before_any_run():
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "fp8_rollout_accuracy.py"), "--device", "cpu"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--modes fp8 needs a CUDA GPU" in done.stderr


@pytest.mark.slow
def test_cpu_smoke_run_reads_the_accuracies_and_importance_weights_of_a_train_run(tmp_path):
    out = tmp_path / "result.json"
    text = run_benchmark(
        "fp8_rollout_accuracy.py", "--device", "cpu", "--modes", "bf16", "--seeds", "1",
        "--steps", "2", "--override", "sft.total_steps=2", "--override",
        "data.builtin_val_size=16", "--override", "actor.rollout_is_cap=2.0",
        "--work-dir", str(tmp_path / "work"), "--json", str(out),
    )  # fmt: skip
    (row,) = markdown_rows(text, "| mode | seed |")
    assert row["correction"] == "TIS, cap 2"  # read back from the run's config.yaml
    (run,) = json.loads(out.read_text())["runs"]
    assert run["final_step"] == 2 and run["initial"] is not None
    # the engine and the trainer agree on the CPU: weights ~1, none capped
    assert run["correction_metrics"]["actor/rollout_is/mean"] == pytest.approx(1.0, abs=1e-3)
    assert run["correction_metrics"]["actor/rollout_is/capped_frac"] == 0.0


def test_a_run_past_its_timeout_is_reported_with_its_last_lines_not_a_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "fp8_rollout_accuracy.py"), "--device", "cpu",
         "--modes", "bf16", "--seeds", "1", "2", "--steps", "2", "--run-timeout", "0.5",
         "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in done.stdout + done.stderr
    # stopped while it still imports (before its SIGTERM handler would let it finish a step)
    assert "bf16 seed 1: stopped after its time limit of 0 s; the run's last lines" in done.stdout
    assert "bf16 seed 2: stopped after its time limit" in done.stdout  # the next still ran
    assert done.returncode == 1 and "no run finished" in done.stderr
    assert (tmp_path / "run-bf16-seed1.log").is_file()  # the run's own output, kept


def test_the_fp8_end_to_end_and_fp8_kv_modes_add_their_keys_and_get_a_verdict_each():
    args = Namespace(steps=7, device=None, override=[])
    train = bench.run_overrides("fp8-train", 1, Path("/w"), args)
    assert train[:2] == ["rollout.dtype=fp8", "actor.precision=fp8"]
    kv = bench.run_overrides("fp8-kv", 1, Path("/w"), args)
    assert kv[:2] == ["rollout.dtype=fp8", "rollout.engine.kv_cache_dtype=fp8"]
    runs = synthetic_runs([0.41, 0.43, 0.45])
    runs += [dict(run, mode="fp8-train", final=run["final"] + 0.1) for run in runs[3:]]
    text = bench.report(runs, "val/arithmetic/mean@4")
    assert "fp8 - bf16 final mean: +0.010, standard error 0.016: within noise" in text
    assert "fp8-train - bf16 final mean: +0.110" in text and "NOT within noise" in text
