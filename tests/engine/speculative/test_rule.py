"""The measured rule of when a tail step verifies (speculative/rule.py): its decision on
synthetic timings, its re-probing, how it credits the wait for a previous chunk, and the
engine wired to it (CPU fp32 eager): a margin no pass can pay turns speculation off after
its probes, with the tokens unchanged and the off steps reported."""

from __future__ import annotations

import pytest

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.speculative.rule import SpeculationRule, choose, pays
from hybridflow.engine.speculative.verify import SpeculationStats

EAGER = dict(decode_backend="torch", cuda_graphs=False, steps_per_sync=4)
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41, 42, 40, 41], list(range(60, 80)) * 2, [12, 13]]


def test_a_pass_pays_when_its_tokens_take_longer_as_decode_steps_by_the_margin():
    # 3 tokens a row at 10 ms a step: 30 ms of decode steps
    assert pays(3.0, 0.010, 0.020, margin=0.1)  # 30 > 22
    assert not pays(3.0, 0.010, 0.028, margin=0.1)  # 30 < 30.8
    assert pays(3.0, 0.010, 0.028, margin=0.0)
    assert not pays(1.0, 0.010, 0.010, margin=0.0)  # nothing accepted: a step's worth, no gain


def test_choose_probes_what_is_unmeasured_then_follows_the_timings():
    assert choose((None, None, None), 0.1, 0, 16) == (True, True)  # a pass first
    assert choose((2.0, None, 0.02), 0.1, 0, 16) == (False, True)  # then a decode step
    assert choose((3.0, 0.01, 0.02), 0.1, 5, 16) == (True, False)  # pays: verify
    assert choose((1.2, 0.01, 0.02), 0.1, 5, 16) == (False, False)  # does not: decode
    # every probe_steps steps the other kind, to measure it again
    assert choose((3.0, 0.01, 0.02), 0.1, 16, 16) == (False, True)
    assert choose((1.2, 0.01, 0.02), 0.1, 16, 16) == (True, True)


def _tail_step(rule, stats, pass_seconds=0.02, emitted=2, step_seconds=0.01, rows=2,
               flush=0.0, chunk=4) -> str:  # fmt: skip
    """One tail step as the scheduler and verify.run_step report it: a pass of
    pass_seconds emitting `emitted` tokens over `rows` rows (after waiting `flush` for the
    chunk before), or the plain steps the rule asks for at step_seconds each."""
    rule.step_started(stats)
    if rule.verify_next():
        rule.flushed(flush)
        stats.passes, stats.rows, stats.emitted = (stats.passes + 1, stats.rows + rows,
                                                   stats.emitted + emitted)  # fmt: skip
        rule.step_ended(stats, flush + pass_seconds, 0)
        return "verify"
    steps = rule.plain_steps(chunk)
    rule.step_ended(stats, steps * step_seconds, steps)
    return "decode"


def test_the_rule_turns_speculation_off_when_passes_stop_paying_and_probes_back():
    rule, stats = SpeculationRule(True, margin=0.1, probe_steps=4), SpeculationStats()
    assert _tail_step(rule, stats, emitted=8) == "verify"  # probe: 4 tokens a row in 20 ms
    assert rule.plain_steps(4) == 4
    assert _tail_step(rule, stats) == "decode"  # probe: one step of 10 ms
    assert rule.timings.estimates() == pytest.approx((4.0, 0.01, 0.02))
    assert _tail_step(rule, stats, emitted=8) == "verify"  # 40 ms of steps in 20: pays
    assert stats.off_steps == 1  # the decode probe
    # the drafts stop matching: a token a row per 20 ms pass; the decayed average follows
    kinds = [_tail_step(rule, stats, emitted=2) for _ in range(14)]
    first_off = kinds.index("decode")
    assert 0 < first_off < 4
    # off: chunks of plain steps, a verify pass every probe_steps steps to measure again
    assert kinds[first_off : first_off + 10] == (["decode"] * 4 + ["verify"]) * 2
    assert stats.off_steps == 1 + kinds.count("decode")
    assert rule.plain_steps(4) == 4  # off: whole chunks
    # the probes find the drafts matching again: speculation back on
    kinds = [_tail_step(rule, stats, emitted=8) for _ in range(10)]
    # (the off run's last two chunks, the probe pass, four passes, a one-step decode probe)
    assert kinds == ["decode"] * 2 + ["verify"] * 5 + ["decode"] + ["verify"] * 2


def test_a_decode_probe_while_speculation_pays_is_one_step():
    rule, stats = SpeculationRule(True, margin=0.1, probe_steps=2), SpeculationStats()
    _tail_step(rule, stats, emitted=8)
    _tail_step(rule, stats)
    kinds = [_tail_step(rule, stats, emitted=8) for _ in range(3)]
    assert kinds == ["verify", "verify", "decode"]
    assert rule.plain_steps(4) == 1 and stats.off_steps == 2  # both decode probes


def test_the_wait_for_the_previous_chunk_is_that_chunks_time():
    rule, stats = SpeculationRule(True, margin=0.1, probe_steps=16), SpeculationStats()
    _tail_step(rule, stats, pass_seconds=0.002, emitted=8)
    assert _tail_step(rule, stats, step_seconds=0.001) == "decode"  # queued, not waited for
    # the pass after it waits 9 ms for it, then takes 2 ms itself
    assert _tail_step(rule, stats, pass_seconds=0.002, emitted=8, flush=0.009) == "verify"
    tokens, step_seconds, pass_seconds = rule.timings.estimates()
    assert step_seconds == pytest.approx(0.01)
    assert pass_seconds == pytest.approx(0.002)


def test_the_rule_always_verifies():
    rule = SpeculationRule(False, margin=0.1, probe_steps=1)
    assert all(rule.verify_next() for _ in range(5))


@pytest.mark.parametrize("rule", ["measured", "always"])
def test_the_engine_turns_speculation_off_where_no_pass_can_pay(model, rule):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True)
    budgets = [40, 12, 40, 25, 33, 40, 7, 40]
    plain = Engine(model, 8, 128, options=EngineOptions(**EAGER))
    expected = plain.generate(PROMPTS, params, max_new_tokens=budgets)
    options = EngineOptions(**EAGER, speculative="ngram", speculative_max_rows=64,
                            speculative_rule=rule, speculative_margin=1e9,
                            speculative_probe_steps=4)  # fmt: skip
    engine = Engine(model, 8, 128, options=options)
    got = engine.generate(PROMPTS, params, max_new_tokens=budgets)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    stats = engine.speculation.stats
    assert stats.passes > 0  # the first tail step probes a pass either way
    metrics = stats.metrics()
    if rule == "measured":  # then decodes, a probe pass every 4 tail steps
        assert metrics["rollout/speculative_off_steps"] > 2 * stats.passes
    else:
        assert metrics["rollout/speculative_off_steps"] == 0
