"""The long tail's clock (scheduling/tail.py): the arithmetic of the seconds verify passes
saved, and the engine counting its tail steps with speculation off and on (CPU fp32 eager)."""

from __future__ import annotations

import dataclasses

import pytest

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.scheduling.tail import (
    TailStats,
    decode_step_seconds,
    in_tail,
    seconds_saved,
    tail_metrics,
)
from hybridflow.engine.speculative.verify import SpeculationStats

EAGER = dict(decode_backend="torch", cuda_graphs=False, steps_per_sync=4)
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41, 42, 40, 41], list(range(60, 80)) * 2, [12, 13]]


def test_the_tail_is_a_few_rows_decoding_with_no_prompt_prefilled():
    assert in_tail(rows=3, prefilling=False, tail_rows=4)
    assert in_tail(rows=4, prefilling=False, tail_rows=4)
    assert not in_tail(rows=5, prefilling=False, tail_rows=4)
    assert not in_tail(rows=0, prefilling=False, tail_rows=4)  # nothing decodes
    assert not in_tail(rows=2, prefilling=True, tail_rows=4)


def test_seconds_saved_are_the_passes_tokens_at_plain_decode_speed_less_the_passes():
    # 10 passes of 2 rows emitting 60 tokens: 3 a row a pass, so 30 decode steps of 0.01 s
    assert seconds_saved(10, 20, 60, 0.12, 0.01) == pytest.approx(0.30 - 0.12)
    # a pass that accepts nothing emits a token a row: it costs what it took beyond a step
    assert seconds_saved(5, 5, 5, 0.10, 0.01) == pytest.approx(0.05 - 0.10)
    assert seconds_saved(0, 0, 0, 0.0, 0.01) == 0.0


def test_decode_step_seconds_leave_the_passes_out_and_wait_for_a_plain_step():
    assert decode_step_seconds(TailStats(steps=8, seconds=1.0, decode_steps=20), 0.6) == 0.02
    assert decode_step_seconds(TailStats(steps=3, seconds=0.5, decode_steps=0), 0.5) is None


def test_tail_metrics_say_the_seconds_saved_once_a_plain_step_was_timed():
    call = TailStats(steps=4, seconds=0.4, decode_steps=4)
    spec_call = SpeculationStats(passes=10, rows=20, drafted=80, accepted=40, emitted=60,
                                 seconds=0.12)  # fmt: skip
    total = TailStats(steps=20, seconds=2.0, decode_steps=100)
    spec_total = dataclasses.replace(spec_call, seconds=1.0)
    metrics = tail_metrics(call, total, (spec_call, spec_total))
    assert metrics["rollout/tail_seconds"] == 0.4
    assert metrics["rollout/tail_decode_steps"] == 4.0
    # (2.0 - 1.0) s / 100 plain steps = 0.01 s a step; 30 steps' worth in 0.12 s
    assert metrics["rollout/speculative_tail_seconds_saved"] == pytest.approx(0.18)
    assert set(tail_metrics(call, total)) == {"rollout/tail_seconds", "rollout/tail_decode_steps"}
    untimed = tail_metrics(call, dataclasses.replace(total, decode_steps=0),
                           (spec_call, spec_total))  # fmt: skip
    assert "rollout/speculative_tail_seconds_saved" not in untimed


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_the_engine_clocks_its_tail(model, speculative):
    options = EngineOptions(**EAGER, speculative=speculative, speculative_max_rows=1,
                            speculative_min_ngram=1, speculative_rule="always")  # fmt: skip
    engine = Engine(model, 4, 64, options=options)
    budgets = [24, 4, 6, 5]  # one row outlives the others by far
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    engine.generate(PROMPTS, params, max_new_tokens=budgets)
    tail = engine.tail
    assert 0 < tail.steps < engine.scheduler.steps  # the tail, not the whole call
    assert tail.seconds > 0
    if speculative == "off":  # every tail step decodes: 24 - 6 steps at most, one row
        assert tail.decode_steps >= 24 - 6 - EAGER["steps_per_sync"]
    else:  # passes in the tail, counted apart from plain decode steps
        assert engine.speculation.stats.passes > 0
        assert tail.decode_steps < 24 - 6
