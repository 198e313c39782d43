"""`hybridflow bench agent` on CPU (tiny preset): episodes generate the scheduled tokens in
several rows per decode step, and the prefill accounting matches the schedule."""

from __future__ import annotations

import json

from hybridflow.cli import main


def test_bench_agent_counts_tokens_and_recomputed_prefill(tmp_path, capsys):
    out = tmp_path / "agent.json"
    args = ["bench", "agent", "--preset", "tiny", "--episodes", "6", "--turns", "3",
            "--prompt-len", "5", "--turn-tokens", "4", "--tool-tokens", "2",
            "--tool-latency-ms", "1", "--device", "cpu", "--dtype", "float32",
            "--engine", "decode_backend=torch", "--json", str(out)]  # fmt: skip
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
