"""`python benchmarks/checkpoint_save.py`: how long training waits at a checkpoint, with
``trainer.async_save`` on and off, through the real RL trainer (a save every step).

    python benchmarks/checkpoint_save.py --presets tiny,qwen2.5-0.5b --device cpu --steps 2

Prints one row per preset and setting, each run in a fresh process: the wall time of the
first save step and the mean of the later ones (what training waits for: with async_save
the copy to host memory — the first one also allocates it — plus any wait for the previous
write), the mean train step (a background write competes with it for CPU cores and memory
bandwidth), the whole run, and the checkpoint's size. Random weights; a few prompts with
short responses, so the save dominates on large presets.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

from hybridflow.config import load_config
from hybridflow.trainer.lifecycle.run import train

SMALL_RUN = [
    "data.train_batch_size=2",
    "data.builtin_train_size=16",
    "data.val_files=[]",
    "data.max_prompt_length=32",
    "data.max_response_length=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "actor.micro_batch_size_per_gpu=4",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.save_freq=1",
    "trainer.keep_last_k=1",
    "trainer.loggers=[jsonl]",
]


def measure(preset: str, async_save: bool, device: str, steps: int, root: Path) -> dict:
    run_dir = root / f"{preset}-{'async' if async_save else 'sync'}"
    cfg = load_config(None, [*SMALL_RUN, f"model.path={preset}", f"trainer.device={device}",
                             f"trainer.total_steps={steps}", f"trainer.async_save={async_save}",
                             f"trainer.run_dir={run_dir}", f"trainer.cache_dir={root / 'cache'}"])  # fmt: skip
    started = time.perf_counter()
    train(cfg, log=lambda *args, **kwargs: None)
    run_s = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    checkpoint = next((run_dir / "checkpoints").glob("step_*"))
    size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    return {
        "preset": preset,
        "async_save": async_save,
        "first_save_s": save_step_s(rows[0]),
        "later_save_s": mean(save_step_s(r) for r in later),
        "later_wait_previous_s": mean(r["timing_s/wait_checkpoint"] for r in later),
        "step_s": mean(r["timing_s/step"] for r in rows),
        "run_s": run_s,
        "checkpoint_gib": size / 2**30,
        "save_s_by_step": [save_step_s(r) for r in rows],
    }


def save_step_s(row: dict) -> float:
    """What the step waited at its save: the save (or copy) and the previous write."""
    return row["timing_s/save_checkpoint"] + row["timing_s/wait_checkpoint"]


def measure_in_child(preset: str, async_save: bool, args) -> dict:
    """One run in a fresh process: each starts with the same free memory and a cold start."""
    command = [sys.executable, __file__, "--one", f"{preset}:{async_save}",
               "--device", args.device, "--steps", str(args.steps)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{preset} async_save={async_save} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny", help="comma-separated model presets")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=2, help="steps (each saves); last reported")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # preset:async_save, in a child
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        if args.one:
            preset, async_save = args.one.split(":")
            row = measure(preset, async_save == "True", args.device, args.steps, Path(root))
            print(json.dumps(row))
            return
        results = [
            measure_in_child(preset, async_save, args)
            for preset in args.presets.split(",")
            for async_save in (False, True)
        ]
    print("| preset | async_save | first save s | later saves s | of which waiting for the "
          "previous write s | train step s | run s | checkpoint GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['preset']} | {str(r['async_save']).lower()} | {r['first_save_s']:.3f} | "
              f"{r['later_save_s']:.3f} | {r['later_wait_previous_s']:.3f} | {r['step_s']:.2f} | "
              f"{r['run_s']:.1f} | {r['checkpoint_gib']:.3f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
