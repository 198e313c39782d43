"""dev/engine_ab.py on CPU: each side runs its own options (or another checkout's code,
imported under its own name), calls interleave, settings that keep the arithmetic give the
same completions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev"))

import engine_ab  # noqa: E402

CPU_RUN = ["--preset", "tiny", "--prompts", "3", "--prompt-len", "4", "--new-tokens", "5",
           "--device", "cpu", "--rounds", "2"]  # fmt: skip


def test_parse_settings_checks_names_and_values():
    assert engine_ab.parse_settings(["sync_lag=1", "decode_layer=split"]) == {
        "sync_lag": 1, "decode_layer": "split"}  # fmt: skip
    with pytest.raises(ValueError, match="NAME=VALUE"):
        engine_ab.parse_settings(["sync_lag"])
    with pytest.raises(ValueError, match="bogus"):
        engine_ab.parse_settings(["bogus=1"])
    with pytest.raises(ValueError, match="decode_layer='fast'"):
        engine_ab.parse_settings(["decode_layer=fast"])


def test_two_option_sides_interleave_and_agree(capsys):
    result = engine_ab.main([*CPU_RUN, "--a", "sync_lag=0", "--b", "sync_lag=1",
                             "steps_per_sync=2"])  # fmt: skip
    assert result["sides"]["B"]["options"] == {"sync_lag": 1, "steps_per_sync": 2}
    assert all(len(runs) == 2 for runs in result["runs_s"].values())
    assert result["same_completions"] == result["completions"] == 3  # sync lag: same tokens
    assert "B / A time per round" in capsys.readouterr().out


def test_a_side_from_another_checkout_runs_its_own_package():
    """This checkout imported a second time under another name (as an older version would
    be): its engine comes from that package and generates the same tokens."""
    result = engine_ab.main([*CPU_RUN, "--a-tree", str(REPO)])
    assert result["sides"]["A"]["package"] == "hybridflow_a"
    assert "hybridflow_a.engine" in sys.modules and "hybridflow_a.engine.engine" in sys.modules
    assert result["same_completions"] == result["completions"] == 3
