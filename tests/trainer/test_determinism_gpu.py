"""Reproducible GPU runs: 4 steps of the GRPO example (0.5b shape, random weights) in one
process equal, bit for bit, 2 steps from the same seed in another process, then a third that
resumes them to 4 across an epoch boundary (needs a CUDA device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Wall-clock and memory readings differ between runs; everything else must be identical.
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "val/")

# 16 prompts of the 32-prompt dataset a step: step 2 ends epoch 0, so a run resumed there
# starts epoch 1 (a new permutation) from the saved sampler position.
OVERRIDES = [
    "model.path=qwen2.5-0.5b",
    "trainer.device=cuda",
    "data.train_batch_size=16",
    "data.builtin_train_size=32",
    "data.val_files=[]",
    # long enough that a sequence spans several of FlashAttention's key blocks, where its
    # backward pass could accumulate dQ in an order that differs between runs
    "data.max_response_length=448",
    "rollout.n=4",
    "rollout.ignore_eos=false",
    "actor.ppo_mini_batch_size=8",
    "actor.lr=1e-5",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.loggers=[jsonl]",
    "trainer.seed=7",
    # a reward random weights earn unevenly (the digits' share of a response): advantages are
    # not all zero, so the update changes the weights the next steps sample from
    f"reward.custom_fn={Path(__file__).parent / 'digit_reward.py'}:digit_fraction",
]


def run(run_dir: Path, cache: Path, *extra: str) -> dict[int, dict]:
    """One fresh `hybridflow train` process; its metrics.jsonl as {step: training metrics}."""
    overrides = [*OVERRIDES, f"trainer.run_dir={run_dir}", f"trainer.cache_dir={cache}", *extra]
    code = "import sys; from hybridflow.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, "train", "--config", str(REPO / "examples" / "grpo.yaml"),
         *overrides],  # fmt: skip
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        row["step"]: {k: v for k, v in row.items() if not k.startswith(VOLATILE)}
        for row in rows
        if row["step"] > 0
    }


def differences(a: dict, b: dict) -> dict:
    return {
        (step, key): (a[step].get(key), b.get(step, {}).get(key))
        for step in a
        for key in a[step]
        if a[step].get(key) != b.get(step, {}).get(key)
    }


def test_a_second_process_with_the_seed_and_a_resumed_third_log_the_metrics_of_one_run(tmp_path):
    cache = tmp_path / "cache"  # the engine's pinned choices, shared as ~/.cache would be
    straight = run(tmp_path / "a", cache, "trainer.total_steps=4", "trainer.save_freq=-1")
    assert sorted(straight) == [1, 2, 3, 4]
    assert straight[1]["response_length/mean"] > 0 and straight[1]["actor/grad_norm"] > 0

    # steps 1-2 of this run directory come from a second fresh process with the same seed
    # (cross-process determinism), steps 3-4 from a third that resumed it (exact resume)
    first_half = run(tmp_path / "b", cache, "trainer.total_steps=2", "trainer.save_freq=2")
    assert sorted(first_half) == [1, 2]
    resumed = run(tmp_path / "b", cache, "trainer.total_steps=4", "trainer.save_freq=2")
    assert sorted(resumed) == [1, 2, 3, 4]
    assert not differences(straight, resumed), differences(straight, resumed)
