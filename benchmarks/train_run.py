"""A `hybridflow train` run in a fresh process, followed as it goes (benchmarks/async_rl.py,
benchmarks/gsm8k_step.py): each step's time printed as its metrics row lands, the run stopped
at a time limit, and the finished steps read back from its metrics.jsonl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = "import sys; from hybridflow.cli import main; sys.exit(main(sys.argv[1:]))"


def timed_run_overrides(
    steps: int, run_dir: Path, cache_dir: Path, device: str | None
) -> list[str]:
    """A run of `steps` steps that only trains: no validation, no checkpoints, the step table
    in its log and the metrics in run_dir; device: trainer.device (None: the default)."""
    return [
        "data.val_files=[]",
        f"trainer.total_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=-1",
        "trainer.loggers=[console,jsonl]",
        f"trainer.run_dir={run_dir}",
        f"trainer.cache_dir={cache_dir}",
        *([f"trainer.device={device}"] if device else []),
    ]


def step_rows(metrics: Path) -> list[dict]:
    """The metrics rows of the steps the run has finished so far."""
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("step", 0) > 0 and "timing_s/step" in row]


def follow(
    child: subprocess.Popen, label: str, metrics: Path, timeout: float, seen: dict[int, float]
) -> bool:
    """Wait for the run, printing each step's time as it lands (a long step is not silence);
    stop it (SIGTERM, then SIGKILL) after `timeout` seconds. seen: filled with each step's
    time.monotonic() when its row was first read (within a second of its end). -> whether it
    was stopped."""
    start, shown = time.monotonic(), 0
    while True:
        finished = child.poll() is not None
        steps = step_rows(metrics)
        for row in steps[shown:]:
            seen[row["step"]] = time.monotonic()
            print(f"  {label} step {row['step']}: {row['timing_s/step']:.2f} s "
                  f"({time.monotonic() - start:.0f} s into the run)", flush=True)  # fmt: skip
        shown = len(steps)
        if finished:
            return False
        if time.monotonic() - start > timeout:
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            return True
        time.sleep(1.0)


def run_train(
    args: list[str], label: str, run_dir: Path, timeout: float
) -> tuple[list[dict], bool]:
    """`hybridflow train *args` (trainer.run_dir=run_dir among them) in a fresh run_dir, its
    output in <run_dir>.log. -> (the finished steps' metrics rows, whether it ran to its end).
    A run that failed, or was stopped before a step finished, prints its last log lines and
    exits."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    log_path = run_dir.parent / f"{run_dir.name}.log"
    metrics = run_dir / "metrics.jsonl"
    # an earlier run's files (a reused --work-dir) would be followed and read as this run's
    # steps, and its checkpoints resumed
    shutil.rmtree(run_dir, ignore_errors=True)
    with log_path.open("w") as log:
        child = subprocess.Popen([sys.executable, "-c", CLI, "train", *args], env=env,
                                 stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        seen: dict[int, float] = {}
        timed_out = follow(child, label, metrics, timeout, seen)
    steps = step_rows(metrics)
    for row in steps:  # when it was seen ended (benchmarks/gpu_busy.py windows)
        row["seen_at"] = seen.get(row["step"], time.monotonic())
    if timed_out or child.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
        what = f"stopped after its time limit of {timeout:.0f} s" if timed_out else (
            f"hybridflow train failed (exit {child.returncode})")  # fmt: skip
        print(f"{label}: {what}; the run's last lines ({log_path}):\n{tail}", flush=True)
        if not timed_out or not steps:
            return [], False
    return steps, not timed_out
