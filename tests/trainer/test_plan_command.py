"""`hybridflow config plan` (trainer/plan_command.py): --gpu-memory sizes, and the settings
left to the plan printed under its table."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.trainer.memory_plan import GIB
from hybridflow.trainer.plan_command import parse_size, plan_command


@pytest.mark.parametrize(
    "text, expected", [("141GiB", 141 * GIB), ("80GB", 80 * 10**9), ("80", 80 * GIB),
                       ("0.5 TiB", 2**39)],
)  # fmt: skip
def test_gpu_memory_sizes(text, expected):
    assert parse_size(text) == expected


def test_config_plan_prints_the_choices():
    out = []
    cfg = load_config(None, ["model.path=qwen2.5-0.5b", "actor.max_tokens_per_gpu=auto"])
    plan_command(cfg, "80GiB", out=out.append)
    assert any("actor.max_tokens_per_gpu=auto: " in line for line in out)
    assert any("model.gradient_checkpointing=auto: off" in line for line in out)
    assert any("actor.log_prob_max_tokens_per_gpu = " in line for line in out)
