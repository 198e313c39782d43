"""`bench rollout` end to end on CPU (tiny preset): both sides generate the same token count."""

from __future__ import annotations

import json

from hybridflow.engine.bench_cli import main


def test_bench_rollout_counts_equal_tokens(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["rollout", "--preset", "tiny", "--prompts", "3", "--prompt-len", "5",
            "--new-tokens", "6", "--n", "2", "--device", "cpu", "--dtype", "float32",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["engine"]["tokens"] == 3 * 2 * 6 == result["hf"]["tokens"]
    assert "tok/s" in capsys.readouterr().out


def test_bench_rollout_mean_length_stops_early(tmp_path):
    out = tmp_path / "r.json"
    args = ["rollout", "--preset", "tiny", "--prompts", "8", "--prompt-len", "4",
            "--new-tokens", "40", "--mean-length", "8", "--max-batch-size", "4",
            "--device", "cpu", "--dtype", "float32", "--no-hf", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    engine = json.loads(out.read_text())["engine"]
    assert engine["stopped"] > 0 and engine["tokens"] < 8 * 40


def test_bench_rollout_sets_and_records_shared_prefix(tmp_path, monkeypatch):
    """--shared-prefix sets shared_prefix.MODE for the run and the JSON says which ran (on
    the CPU's torch backend nothing is shared, and the tokens are the same count)."""
    import pytest

    shared_prefix = pytest.importorskip("hybridflow.engine.shared_prefix")
    monkeypatch.setattr(shared_prefix, "MODE", "off")  # restored after the test
    out = tmp_path / "r.json"
    args = ["rollout", "--preset", "tiny", "--prompts", "2", "--prompt-len", "4",
            "--new-tokens", "3", "--n", "3", "--device", "cpu", "--dtype", "float32",
            "--no-hf", "--shared-prefix", "auto", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    engine = json.loads(out.read_text())["engine"]
    assert engine["shared_prefix"] == "auto" == shared_prefix.MODE
    assert engine["tokens"] == 2 * 3 * 3
