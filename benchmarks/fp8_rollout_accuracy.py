"""`python benchmarks/fp8_rollout_accuracy.py`: does GRPO with an FP8 rollout (and the truncated
importance sampling it turns on) reach the validation accuracy of the bf16 rollout's run?

    python benchmarks/fp8_rollout_accuracy.py --seeds 1 2 3 --steps 20             # one H200
    python benchmarks/fp8_rollout_accuracy.py --device cpu --modes bf16 --seeds 1 --steps 2 \\
        --override sft.total_steps=10 --override data.builtin_val_size=16            # smoke run

The workload is examples/grpo.yaml: GRPO on the built-in arithmetic task from the ``sft:``
warm start (model.path=sft:arithmetic, a tiny model SFT-trained until it is partly right).
Each (mode, seed) is one fresh `hybridflow train` process with trainer.seed=SEED; the warm start
is cached per seed under one trainer.cache_dir shared by all runs, so both modes of a seed start
from the same model and the SFT runs once per seed. Modes: bf16 (rollout.dtype=model: the
trainer's bf16 compute weights) and fp8 (rollout.dtype=fp8: W8A8 e4m3 on sm_89+ GPUs with the
triton backend; with it actor.rollout_is_cap defaults to 2.0, trainer/run.async_defaults),
fp8-train (and actor.precision=fp8: the rollout multiplies by the trainer's own e4m3 weights,
so its IS metrics are the FP8 end-to-end mismatch) and fp8-kv (and
rollout.engine.kv_cache_dtype=fp8). Each mode other than bf16 gets its verdict against bf16.
Each run validates before the first step and after the last (val/arithmetic/mean@4 by default).
Its output goes to WORK/run-MODE-seedSEED.log (benchmarks/train_run.py); a run that fails or
passes --run-timeout is said with its last lines and left out of the table (the others still
run; the exit status is 1).

Printed: initial and final accuracy of each run, the correction it trained with (read from the
run's config.yaml), the mean of the importance-weight metrics it logged (actor/rollout_is/*:
mean weight, share capped, mean |old - rollout log-prob|); per mode the mean ± sample std of the
final accuracy; and the verdict. Within noise: |mean_fp8 - mean_bf16| <= 2 × the standard error
of the difference of two means, pooled_std × sqrt(1/n_bf16 + 1/n_fp8) (pooled_std: the
two modes' sample variances pooled); with one seed per mode there is no std, and no verdict.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_run import run_train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "bf16": ["rollout.dtype=model"],
    "fp8": ["rollout.dtype=fp8"],
    # FP8 end to end: the rollout multiplies by the trainer's own e4m3 weights and scales
    "fp8-train": ["rollout.dtype=fp8", "actor.precision=fp8"],
    # the FP8 rollout with its K/V cached in e4m3 too (engine/cache/fp8_kv.py)
    "fp8-kv": ["rollout.dtype=fp8", "rollout.engine.kv_cache_dtype=fp8"],
}
CORRECTION_METRICS = ("rollout_is", "is_weight", "tis", "rollout_logprob")
"""Substrings of the logged metric names about the rollout/trainer log-prob mismatch."""


def run_overrides(mode: str, seed: int, work: Path, args) -> list[str]:
    """The `hybridflow train` overrides of one (mode, seed) run, after examples/grpo.yaml."""
    return [
        *MODES[mode],
        f"trainer.seed={seed}",
        f"trainer.total_steps={args.steps}",
        "trainer.val_before_train=true",
        "trainer.test_freq=0",  # validation before the first step and after the last only
        "trainer.save_freq=-1",
        "trainer.loggers=[jsonl]",
        f"trainer.run_dir={work / f'run-{mode}-seed{seed}'}",
        f"trainer.cache_dir={work / 'cache'}",  # the warm start of each seed, trained once
        *([f"trainer.device={args.device}"] if args.device else []),
        *args.override,
    ]


def train_args(overrides: list[str]) -> list[str]:
    """The `hybridflow train` arguments of a run: examples/grpo.yaml, then the overrides."""
    return ["--config", str(REPO / "examples" / "grpo.yaml"), *overrides]


def read_run(run_dir: Path, metric: str) -> dict:
    """Initial and final ``metric``, the correction and the mean correction metrics of a run."""
    import yaml

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validated = [row for row in rows if metric in row]
    if not validated:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no {metric}: see --metric")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    cap = config["actor"]["rollout_is_cap"]
    steps = [row for row in rows if row.get("step", 0) > 0]
    names = sorted({k for row in steps for k in row if any(s in k for s in CORRECTION_METRICS)})
    return {
        "initial": validated[0][metric] if validated[0]["step"] == 0 else None,
        "final": validated[-1][metric],
        "final_step": validated[-1]["step"],
        "rollout_dtype": config["rollout"]["dtype"],
        "correction": "none" if cap is None else f"TIS, cap {cap:g}",
        "correction_metrics": {k: mean_of(row.get(k) for row in steps) for k in names},
    }


def mean_of(values) -> float:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else math.nan


def run_one(mode: str, seed: int, work: Path, args) -> dict | None:
    """One (mode, seed) `hybridflow train` (its output in work/run-MODE-seedSEED.log, its steps
    printed as they end); its result, or None when it failed or ran past --run-timeout
    (run_train says so, with the run's last lines), so the other runs still go on."""
    run_dir = work / f"run-{mode}-seed{seed}"
    print(f"=== {mode}, seed {seed} ===", flush=True)
    started = time.monotonic()
    _, complete = run_train(train_args(run_overrides(mode, seed, work, args)),
                            f"{mode} seed {seed}", run_dir, args.run_timeout)  # fmt: skip
    if not complete:
        return None
    seconds = time.monotonic() - started
    print(f"{mode} seed {seed}: done in {seconds:.0f} s", flush=True)
    return {"mode": mode, "seed": seed, "seconds": seconds, **read_run(run_dir, args.metric)}


def mode_summary(results: list[dict]) -> dict[str, dict]:
    """Per mode: the final accuracies, their mean and sample std (None from one seed)."""
    summary = {}
    for mode in dict.fromkeys(r["mode"] for r in results):
        finals = [r["final"] for r in results if r["mode"] == mode]
        std = statistics.stdev(finals) if len(finals) > 1 else None
        summary[mode] = {"finals": finals, "mean": statistics.fmean(finals), "std": std}
    return summary


def within_noise(base: list[float], other: list[float]) -> dict:
    """mean(other) - mean(base), the standard error of that difference from the pooled sample
    variance, and whether |difference| <= 2 standard errors (None without a variance)."""
    diff = statistics.fmean(other) - statistics.fmean(base)
    dof = len(base) + len(other) - 2
    if dof <= 0:
        return {"diff": diff, "stderr": None, "within": None}
    squares = sum((x - statistics.fmean(xs)) ** 2 for xs in (base, other) for x in xs)
    pooled_std = math.sqrt(squares / dof)
    stderr = pooled_std * math.sqrt(1 / len(base) + 1 / len(other))
    return {"diff": diff, "stderr": stderr, "within": abs(diff) <= 2 * stderr}


def report(results: list[dict], metric: str) -> str:
    def cell(value):
        return "-" if value is None or math.isnan(value) else f"{value:.3f}"

    lines = [
        f"{metric}, examples/grpo.yaml from the sft: warm start",
        "| mode | seed | rollout.dtype | correction | initial | final | IS metrics (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        shown = ", ".join(f"{k}={v:.4g}" for k, v in r["correction_metrics"].items()) or "-"
        lines.append(f"| {r['mode']} | {r['seed']} | {r['rollout_dtype']} | {r['correction']} "
                     f"| {cell(r['initial'])} | {cell(r['final'])} | {shown} |")  # fmt: skip
    summary = mode_summary(results)
    lines += ["", "| mode | seeds | final mean | final std |", "|---|---|---|---|"]
    for mode, s in summary.items():
        lines.append(f"| {mode} | {len(s['finals'])} | {cell(s['mean'])} | {cell(s['std'])} |")
    for mode in summary:
        if mode != "bf16" and "bf16" in summary:
            noise = within_noise(summary["bf16"]["finals"], summary[mode]["finals"])
            lines.append(verdict(noise, mode))
    return "\n".join(lines)


def verdict(noise: dict, mode: str = "fp8") -> str:
    head = f"{mode} - bf16 final mean: {noise['diff']:+.3f}"
    if noise["within"] is None:
        return f"{head}; one seed per mode: no std, no verdict (run --seeds 1 2 3)"
    word = "within noise" if noise["within"] else "NOT within noise"
    return (f"{head}, standard error {noise['stderr']:.3f}: {word} "
            f"(rule: |diff| <= 2 x pooled std x sqrt(1/n_bf16 + 1/n_fp8))")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["bf16", "fp8"], choices=sorted(MODES))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="trainer.seed values")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps of each run")
    p.add_argument("--metric", default="val/arithmetic/mean@4", help="the accuracy compared")
    p.add_argument("--device", default=None, help="trainer.device (cpu: a bf16 smoke run)")
    p.add_argument("--override", action="append", default=[], help="a config override, every run")
    p.add_argument("--work-dir", default=None, help="runs and the shared cache (default: temp)")
    p.add_argument("--run-timeout", type=float, default=1200)
    p.add_argument("--json", default=None)
    return p


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if "fp8" in args.modes and args.device == "cpu":
        parser.error("--modes fp8 needs a CUDA GPU (sm_89+); on the CPU run --modes bf16")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-fp8-"))
    work.mkdir(parents=True, exist_ok=True)
    # seed-major: a seed's warm start is trained by its first run, reused by the other mode
    runs = [(mode, seed) for seed in args.seeds for mode in args.modes]
    finished = {run: run_one(*run, work, args) for run in runs}
    results = [r for r in finished.values() if r is not None]
    missing = [f"{mode} seed {seed}" for (mode, seed), r in finished.items() if r is None]
    if not results:
        raise SystemExit("no run finished: nothing to compare (the runs' last lines are above)")
    results.sort(key=lambda r: (args.modes.index(r["mode"]), r["seed"]))
    print(report(results, args.metric))
    if args.json:
        summary = mode_summary(results)
        out = {"runs": results, "modes": summary}
        if "bf16" in summary and "fp8" in summary:
            out["fp8_vs_bf16"] = within_noise(summary["bf16"]["finals"], summary["fp8"]["finals"])
        out["missing"] = missing
        Path(args.json).write_text(json.dumps(out, indent=1))
    if missing:
        raise SystemExit(f"not finished, left out of the table: {', '.join(missing)}")


if __name__ == "__main__":
    main()
