"""`hybridflow bench agent` on CPU (tiny preset): episodes generate the scheduled tokens in
several rows per decode step, and the prefill accounting matches the schedule."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest
from progress_helpers import recording_reporter

from hybridflow.bench.agent import add_agent_arguments, bench_agent
from hybridflow.bench.common import WARM_UP
from hybridflow.cli import main


def test_bench_agent_counts_tokens_and_recomputed_prefill(tmp_path, capsys):
    out = tmp_path / "agent.json"
    args = ["bench", "agent", "--preset", "tiny", "--episodes", "6", "--turns", "3",
            "--prompt-len", "5", "--turn-tokens", "4", "--tool-tokens", "2",
            "--tool-latency-ms", "1", "--device", "cpu", "--dtype", "float32",
            "--engine", "decode_backend=torch", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    agent = result["agent"]
    assert agent["generated_tokens"] == 6 * 3 * 4 == result["single_turn"]["generated_tokens"]
    assert agent["mean_rows_per_step"] > 2  # concurrent episodes share decode steps
    # kept KV: 5, then (the last sampled token + 2 tool tokens) twice; 9 of them needed
    assert agent["prefilled_tokens"] == 6 * (5 + 3 + 3)
    assert abs(result["prefill_recomputed_over_context"] - (11 - 9) / 21) < 1e-9
    assert "agent / single-turn" in capsys.readouterr().out
    assert result["kv_evictions"] == 0  # the single-turn call found every slot free
    # without kept KV every turn prefills its conversation: 5, 5+4+2, 5+2*(4+2)
    assert main([*args, "--no-kept-kv"]) == 0
    result = json.loads(out.read_text())
    assert result["agent"]["prefilled_tokens"] == 6 * (5 + 11 + 17)
    assert abs(result["prefill_recomputed_over_context"] - (33 - 9) / 21) < 1e-9


def test_bench_agent_names_a_bad_engine_option(capsys):
    assert main(["bench", "agent", "--preset", "tiny", "--engine", "decode_layer=fast"]) == 2
    assert "decode_layer='fast'" in capsys.readouterr().err


def test_bench_agent_alternates_timed_pairs_and_keeps_their_medians(tmp_path, capsys):
    out = tmp_path / "agent.json"
    assert main(["bench", "agent", "--preset", "tiny", "--episodes", "3", "--turns", "2",
                 "--prompt-len", "4", "--turn-tokens", "3", "--tool-tokens", "1",
                 "--tool-latency-ms", "0", "--device", "cpu", "--dtype", "float32",
                 "--engine", "decode_backend=torch", "--repeats", "3",
                 "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    pairs = result["pairs"]
    assert result["repeats"] == len(pairs) == 3
    tokens = 3 * 2 * 3
    for pair in pairs:  # each ratio is its own pair's, the same tokens on both sides
        assert pair["ratio"] == pytest.approx(pair["single_turn_s"] / pair["agent_s"])
    assert result["agent_over_single_turn"] == statistics.median(p["ratio"] for p in pairs)
    assert result["agent"]["seconds"] == statistics.median(p["agent_s"] for p in pairs)
    assert result["single_turn"]["tokens_per_s"] == pytest.approx(
        tokens / statistics.median(p["single_turn_s"] for p in pairs)
    )
    assert "medians of 3 alternating pairs" in capsys.readouterr().out


def test_bench_agent_refuses_no_timed_pair(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "agent", "--preset", "tiny", "--repeats", "0"])
    assert stop.value.code == 2
    assert "--repeats: must be at least 1, got 0" in capsys.readouterr().err


def test_bench_agent_reports_each_phase_while_it_runs():
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "--episodes", "2", "--turns", "2",
                              "--prompt-len", "3", "--turn-tokens", "2", "--tool-tokens", "1",
                              "--tool-latency-ms", "0", "--device", "cpu", "--repeats", "2",
                              "--engine", "decode_backend=torch"])  # fmt: skip
    reporter, log, opened = recording_reporter()
    bench_agent(args, progress=reporter)
    assert opened == ["loading tiny", WARM_UP, "timed pairs"]
    assert "timed pairs: 1/2 pairs (50%)" in log.getvalue()
    assert "timed pairs: done, 2 pairs" in log.getvalue()


@pytest.mark.parametrize("budget", [0, 4])
def test_bench_agent_step_table_counts_the_timed_runs_steps(tmp_path, capsys, budget):
    out = tmp_path / "agent.json"
    assert main(["bench", "agent", "--preset", "tiny", "--episodes", "3", "--turns", "2",
                 "--prompt-len", "4", "--turn-tokens", "3", "--tool-tokens", "1",
                 "--tool-latency-ms", "0", "--device", "cpu", "--repeats", "2", "--step-table",
                 "--engine", "decode_backend=torch", "--engine",
                 f"max_prefill_tokens_per_step={budget}", "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    agent = result["step_tables"]["agent"]["by_kind"]
    # every prompt token the two timed agent runs prefilled is in a step of the log
    assert sum(kind["tokens"] for kind in agent.values()) == 2 * result["agent"]["prefilled_tokens"]
    single = result["step_tables"]["single-turn"]["by_kind"]
    assert sum(kind["tokens"] for kind in single.values()) == 2 * 3 * 4
    assert sum(kind["forwards"] for kind in single.values()) >= 2 * (2 * 3 - 1)
    printed = capsys.readouterr().out
    assert "scheduler steps of the 2 timed agent runs" in printed
    assert "| step kind | steps |" in printed
