"""dev/engine_step.py on CPU: the step anatomy runs the engine's own decode step at
the call's mean cache length, and its kernel table accounts for the step's ops."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dev"))

import engine_step  # noqa: E402


def test_anatomy_parts_and_kernel_table_on_cpu():
    result = engine_step.anatomy("tiny", rows=4, length=16, new_tokens=8,
                                 device=torch.device("cpu"), kernels=10)  # fmt: skip
    assert result["cached_tokens"] == 16 + 8 // 2
    # every timed step ran at that length: the replays did not move the rows on
    assert result["live_positions"] == [result["cached_tokens"]] * 4
    parts = result["parts_us"]
    assert set(parts) >= {"step (graph the engine replays)", "forward + lm_head", "lm_head",
                          "sampler", "generate() per step (wall - TTFT)"}  # fmt: skip
    assert all(us > 0 for us in parts.values())
    table = result["kernels"]
    assert 0 < len(table) <= 10
    assert table == sorted(table, key=lambda r: -r["us_per_step"])
    names = " ".join(row["kernel"] for row in table)
    assert "mm" in names  # the projections ran inside the profiled step
