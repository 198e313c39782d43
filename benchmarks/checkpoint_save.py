"""`python benchmarks/checkpoint_save.py`: how long training waits at a checkpoint, with
``trainer.async_save`` on and off, through the real RL trainer (a save every step).

    python benchmarks/checkpoint_save.py --presets tiny,qwen2.5-0.5b --device cpu --steps 2

Prints one row per preset and setting: the wall time of the last step's save (what training
waits for: with async_save only the copy to host memory, plus any wait for the previous
write), the step itself, the whole run, and the checkpoint's size. Random weights; a few
prompts with short responses, so the save dominates on large presets.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hybridflow.config import load_config
from hybridflow.trainer.run import train

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
    last = rows[-1]
    checkpoint = next((run_dir / "checkpoints").glob("step_*"))
    size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    return {
        "preset": preset,
        "async_save": async_save,
        "save_s": last["timing_s/save_checkpoint"],
        "wait_previous_s": last.get("timing_s/wait_checkpoint", 0.0),
        "step_s": last["timing_s/step"],
        "run_s": run_s,
        "checkpoint_gib": size / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny", help="comma-separated model presets")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=2, help="steps (each saves); last reported")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as root:
        for preset in args.presets.split(","):
            for async_save in (False, True):
                results.append(measure(preset, async_save, args.device, args.steps, Path(root)))
    print("| preset | async_save | save step s | of which waiting for the previous s | "
          "train step s | run s | checkpoint GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['preset']} | {str(r['async_save']).lower()} | {r['save_s']:.3f} | "
              f"{r['wait_previous_s']:.3f} | {r['step_s']:.2f} | {r['run_s']:.1f} | "
              f"{r['checkpoint_gib']:.3f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
