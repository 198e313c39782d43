"""Tiny CPU runs of the RL trainer: a ~0.1M-parameter preset, 4 prompts x 4 samples."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hybridflow.config import load_config

REPO = Path(__file__).resolve().parents[2]
DIGIT_REWARD = f"{Path(__file__).parent / 'digit_reward.py'}:digit_fraction"

# Shrinks any example config to a run of a few seconds; keys the examples set are overridden.
TINY = [
    "model.path=tiny",
    "data.train_batch_size=4",
    "data.builtin_train_size=64",
    "data.builtin_val_size=8",
    "data.val_batch_size=8",
    "data.max_response_length=6",
    "rollout.n=4",
    "rollout.val_temperature=0",
    "rollout.val_n=1",
    "actor.ppo_mini_batch_size=4",
    "actor.micro_batch_size_per_gpu=8",
    "critic.micro_batch_size_per_gpu=8",
    "critic.ppo_mini_batch_size=4",
    "trainer.total_steps=2",
    "trainer.test_freq=0",
    "trainer.device=cpu",
    "trainer.loggers=[jsonl]",
    f"reward.custom_fn={DIGIT_REWARD}",
]

CLOCKED = ("rollout/tail_seconds", "rollout/tail_decode_steps", "rollout/speculative_seconds",
           "rollout/speculative_tail_seconds_saved")  # fmt: skip
"""Metric keys outside timing_s/ that are wall-clock readings (the engine clocks the rollout's
tail and its verify passes) or counts of the steps those clocks cover (in async mode they
depend on when requests arrive): runs that must match leave them out, as they do timing_s/."""


def tiny_config(tmp_path: Path, *overrides: str, example: str | None = None):
    """An example's config (or the defaults) shrunk by TINY, writing under ``tmp_path``."""
    path = REPO / "examples" / f"{example}.yaml" if example else None
    run = [f"trainer.run_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path / 'cache'}"]
    return load_config(path, [*TINY, *run, *overrides])


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl as {step: metrics}."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def command_line(cfg) -> list[str]:
    """``section.key=value`` overrides that rebuild ``cfg``'s scalar settings in a subprocess."""
    return [
        f"{section}.{key}={value}"
        for section, values in (
            ("trainer", cfg.trainer),
            ("data", cfg.data),
            ("rollout", cfg.rollout),
            ("actor", cfg.actor),
            ("critic", cfg.critic),
            ("reward", cfg.reward),
            ("model", cfg.model),
        )
        for key, value in vars(values).items()
        if value is not None
        and not isinstance(value, (list, dict))
        and not dataclasses.is_dataclass(value)  # rollout.engine: its defaults
    ] + ["trainer.loggers=[jsonl]"]


def one_step_0_5b(run_dir) -> list[str]:
    """One GRPO step of the 0.5b preset on a GPU: 32 prompts × 4 samples of up to 64 + 448
    tokens (forced to full length), two optimizer steps (the second holds AdamW's state
    during its forward/backward, as every later step does), 16,384-token micro-batches."""
    return [
        "model.path=qwen2.5-0.5b",
        "trainer.device=cuda",
        "data.train_batch_size=32",
        "data.builtin_train_size=64",
        "data.val_files=[]",
        "data.max_prompt_length=64",
        "data.max_response_length=448",
        "rollout.n=4",
        "rollout.ignore_eos=true",
        "rollout.max_num_seqs=128",
        "actor.ppo_mini_batch_size=16",
        "actor.max_tokens_per_gpu=16384",
        "actor.lr=1e-6",
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        f"trainer.run_dir={run_dir}",
    ]
