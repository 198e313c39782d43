"""benchmarks/engine_ab.py on CPU: each side's settings are in force for its own engine's
warm-up and calls only (never the other side's), the timed calls alternate A B B A, and the
module globals are restored afterwards."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine_ab  # noqa: E402

from hybridflow.engine import Engine, loop  # noqa: E402


def test_parse_settings_splits_globals_from_engine_keywords():
    globals_, kwargs = engine_ab.parse_settings(["loop.SYNC_LAG=1", "lean.MODE=off",
                                                 "steps_per_sync=16"])  # fmt: skip
    assert globals_ == {("loop", "SYNC_LAG"): 1, ("lean", "MODE"): "off"}
    assert kwargs == {"steps_per_sync": 16}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        engine_ab.parse_settings(["loop.SYNC_LAG"])
    with pytest.raises(ValueError, match="has no NOPE"):
        engine_ab.parse_settings(["loop.NOPE=1"])


def test_each_side_runs_under_its_own_settings(monkeypatch):
    seen = []
    real = Engine.generate

    def probe(self, prompts, params):
        seen.append((loop.SYNC_LAG, self.steps_per_sync))
        return real(self, prompts, params)

    monkeypatch.setattr(Engine, "generate", probe)
    before = loop.SYNC_LAG
    args = argparse.Namespace(preset="tiny", prompts=3, prompt_len=5, new_tokens=4,
                              dtype="float32", device="cpu", rounds=2)  # fmt: skip
    result = engine_ab.run_ab(args, {"A": ["loop.SYNC_LAG=0"],
                                     "B": ["loop.SYNC_LAG=1", "steps_per_sync=4"]})  # fmt: skip
    a, b = (0, 8), (1, 4)
    assert seen == [a, b, a, b, b, a]  # warm-ups, then rounds A B and B A
    assert loop.SYNC_LAG == before
    assert len(result["runs_s"]["A"]) == len(result["runs_s"]["B"]) == 2
    assert result["tokens_per_s"]["A"] > 0 and len(result["b_over_a_time"]["all"]) == 2
    assert result["same_completions"] == result["completions"] == 3  # sync lag: same tokens


def test_clear_tuners_empties_the_autotuner_caches():
    """--retune relies on this: a tile left in a tuner's cache would be reused by the other
    side's engine instead of being tuned under its own settings."""
    pytest.importorskip("triton")
    from hybridflow.engine import attention_kernels

    tuner = attention_kernels._decode_attention_tuned
    tuner.cache[("a key",)] = "a config"
    assert engine_ab.clear_tuners() >= 1
    assert tuner.cache == {}
