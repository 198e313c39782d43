"""benchmarks/agent_steps.py on CPU: bench agent's episodes through the scheduler on the
modeled clock, each variant's steps by kind; the prompt tokens every variant prefills are
the episodes' (kept KV: the first prompt, then the last sampled token and the tool's)."""

from __future__ import annotations

import pytest
from benchmark_run import load_script, number, run_benchmark

ARGS = ("--episodes", "6", "--turns", "2", "--prompt-len", "6", "--turn-tokens", "4",
        "--tool-tokens", "2", "--budget", "8", "--tool-latency-ms", "1")  # fmt: skip


def _all_rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| all |")]  # fmt: skip


@pytest.mark.slow
def test_every_variant_prefills_the_episodes_tokens_and_decodes_theirs():
    out = run_benchmark("agent_steps.py", *ARGS)
    rows = _all_rows(out)
    assert len(rows) == 3 * 2  # passes, eager, static: the agent and single-turn runs
    for agent, single in zip(rows[::2], rows[1::2]):
        given, computed = (number(v) for v in agent[4].split(" / "))
        assert given == 6 * 6 + 6 * (1 + 2) and computed >= given
        assert number(single[4].split(" / ")[0]) == 6 * 6
        # every token after each request's first comes from a decode forward of its row
        assert number(agent[3].split(" / ")[0]) >= 6 * 2 * (4 - 1)
    assert "static: agent / single-turn" in out and "mixed static" in out


def test_the_modeled_clock_prices_steps_by_their_computed_work():
    module = load_script("agent_steps.py")
    costs = module.DeviceCosts(decode_ms=1.0, row_ms=0.01, token_ms=0.001, eager_ms=5.0,
                               step_ms=0.5)  # fmt: skip
    record = module.step_log.StepRecord
    decode = record("decode", 8, 100, 112, 0, 0, 0, 0, 0, 0.0)
    assert costs.seconds(decode) == pytest.approx(8 * (1.0 + 0.01 * 112) / 1000)
    static = record("mixed static", 1, 100, 112, 300, 512, 1, 0, 0, 0.0)
    assert costs.seconds(static) == pytest.approx((1.0 + 1.12 + 0.512) / 1000)
    # an eager prefill: its launches (5 ms + the step's 0.5) outlast its device time (1 ms);
    # its results read at once add the read (0.5) after it
    prefill = record("prefill", 0, 0, 0, 1000, 1000, 1, 0, 1, 0.0)
    assert costs.seconds(prefill) == pytest.approx((0.5 + 5.0 + 0.5) / 1000)
