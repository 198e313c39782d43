"""Mixed steps (mixed.py, EngineOptions.max_prefill_tokens_per_step): decode rows and chunks
of prompts in one forward sample exactly what separate prefill passes and decode steps
sample (CPU, fp32 eager), with n samples per prompt, a paged cache that preempts, kept KV
and the rollout service; and a long prompt is chunked so the rows decode at every step."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.serving.service import RolloutService

EAGER = dict(decode_backend="torch", cuda_graphs=False, steps_per_sync=2)
# lengths 18, 2, 32, 1, 11, 5: more requests than slots, so prompts arrive while rows decode
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], list(range(60, 92)), [12],
           [100, 3, 8, 19, 23, 60, 61, 62, 63, 7, 9], [70, 71, 72, 73, 74]]  # fmt: skip
SAMPLED = SamplingParams(n=2, temperature=0.9, max_new_tokens=20, seed=3, ignore_eos=True)


def _engine(model, per_step=0, slots=4, budget=None, block=None, seq=96) -> Engine:
    options = EngineOptions(**EAGER, max_prefill_tokens_per_step=per_step, kv_block_size=block)
    return Engine(model, slots, seq, memory_budget=budget, options=options)


def _assert_same(got, expected):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected):  # other matmul shapes: equal up to fp32 rounding
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block", [None, 16])
def test_mixed_steps_sample_as_separate_prefill_passes(model, block):
    budgets = [20, 3, 9, 14, 5, 20, 7, 11, 16, 2, 20, 6]  # rows leave at different steps
    expected = _engine(model, block=block).generate(PROMPTS, SAMPLED, max_new_tokens=budgets)
    engine = _engine(model, per_step=7, block=block)
    _assert_same(engine.generate(PROMPTS, SAMPLED, max_new_tokens=budgets), expected)
    assert engine.scheduler.mixed_steps > 0  # prompts were prefilled beside decoding rows
    assert not engine.scheduler.prefilling
    if block is not None:
        assert engine.blocks.free_blocks == engine.blocks.num_blocks


def test_mixed_steps_with_preemption_keep_every_token(model):
    """A budget of 14 blocks of 16 for 8 sequences growing to 2-4 blocks: the newest are
    preempted and prefilled again, and sample what separate passes without preemption do."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=5, ignore_eos=True)
    prompts = PROMPTS[:4]
    reference = _engine(model, slots=8, block=16)
    expected = reference.generate(prompts, params)
    cache = reference.cache
    block_bytes = cache.keys[:, 0].numel() * cache.keys.element_size() * 2
    engine = _engine(model, per_step=9, slots=8, block=16, budget=block_bytes * 15)
    got = engine.generate(prompts, params)
    assert engine.cache.num_blocks == 14 and engine.scheduler.paging.preemptions > 0
    _assert_same(got, expected)


@pytest.mark.parametrize("block", [None, 16])
def test_kept_kv_continues_in_mixed_steps_as_in_an_extend_pass(model, block):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    deltas = [[7, 8, 9], [11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [44, 45]]

    def two_turns(engine):
        first = engine.generate(PROMPTS[:4], params, seeds=[1, 2, 3, 4], keep=True)
        prompts = [p + c.token_ids + d for p, c, d in zip(PROMPTS, first, deltas)]
        before = engine.prefill_tokens
        second = engine.generate(prompts, params, seeds=[5, 6, 7, 8],
                                 reuse=[c.kv_handle for c in first])  # fmt: skip
        return first + second, engine.prefill_tokens - before

    expected, _ = two_turns(_engine(model, slots=8, block=block))
    got, prefilled = two_turns(_engine(model, per_step=5, slots=8, block=block))
    _assert_same(got, expected)
    assert prefilled == sum(len(d) + 1 for d in deltas)  # only what each turn added


def test_a_long_prompt_is_chunked_and_the_rows_decode_at_every_step(model):
    engine = _engine(model, per_step=8, slots=4)
    engine.start_generation()
    scheduler = engine.scheduler
    params = SamplingParams(temperature=0.9, max_new_tokens=30, seed=1, ignore_eos=True)
    decoding = engine.submission([[1, 2, 3]], params)
    scheduler.add(decoding)
    scheduler.step()  # its prompt in one chunk; the row decodes from the next step on
    assert len(scheduler.rows) == 1 and not scheduler.prefilling
    scheduler.add(engine.submission([list(range(10, 50))], params))  # 40 tokens: 5 chunks
    for chunk in range(1, 6):
        before = scheduler.decode_steps
        scheduler.step()
        assert scheduler.decode_steps == before + 1  # the row advanced beside the chunk
        assert [job.done for job in scheduler.prefilling] == ([8 * chunk] if chunk < 5 else [])
    assert len(scheduler.rows) == 2 and scheduler.mixed_steps == 5


def test_service_requests_in_mixed_steps_sample_as_alone(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    expected = [_engine(model).generate([p], params, seeds=[i])[0] for i, p in enumerate(PROMPTS)]
    with RolloutService(_engine(model, per_step=6)) as service:
        first = service.submit(PROMPTS[0], params, seed=0, stream=True)
        next(iter(first.stream(timeout=60)))  # decoding while the rest arrive
        handles = [service.submit(p, params, seed=i) for i, p in enumerate(PROMPTS) if i]
        got = [h.result(timeout=60)[0] for h in [first, *handles]]
        aborted = service.submit(PROMPTS[2], params, seed=9)
        aborted.abort()
        assert aborted.result(timeout=60)[0].finish_reason == "abort"
        assert service.engine.scheduler.mixed_steps > 0
    _assert_same(got, expected)


def test_max_prefill_tokens_per_step_is_validated():
    assert EngineOptions(max_prefill_tokens_per_step=-1).validate() == [
        "max_prefill_tokens_per_step=-1: must be an integer >= 0 (0: prefill passes of their own)"
    ]
    assert EngineOptions(max_prefill_tokens_per_step=2048).validate() == []
    assert EngineOptions(max_prefill_tokens=1024, max_prefill_tokens_per_step=2048).validate() == [
        "max_prefill_tokens_per_step=2048: at most max_prefill_tokens=1024 (the prefill "
        "activations' reserve)"
    ]


def test_a_burst_while_nothing_decodes_is_prefilled_before_its_rows_decode(model):
    """Six prompts at once, two prefill steps' worth (max_prefill_tokens 40): the second
    step takes the rest without the rows the first admitted, so every row decodes from the
    same step on (none a step's budget behind), and each samples as with separate passes."""
    params = SamplingParams(temperature=0.9, max_new_tokens=6, seed=2, ignore_eos=True)
    options = EngineOptions(**EAGER, max_prefill_tokens_per_step=4, max_prefill_tokens=40)
    engine = Engine(model, 8, 64, options=options)
    engine.start_generation()
    scheduler = engine.scheduler
    scheduler.step_log = []
    got = engine.generate(PROMPTS, params)
    kinds = [step.kind for step in scheduler.step_log]
    assert kinds[:2] == ["prefill", "prefill"] and "mixed eager" not in kinds
    assert scheduler.mixed_steps == 0 and scheduler.step_log[2].rows == len(PROMPTS)
    _assert_same(got, _engine(model, slots=8).generate(PROMPTS, params))


def test_a_prefill_steps_rows_are_read_back_while_the_next_step_runs(model):
    """With the read-back lag, the first tokens of a step that only prefilled are read after
    the next step's decode chunk is queued: the host does not wait for the prefill."""
    options = EngineOptions(**{**EAGER, "sync_lag": 1}, max_prefill_tokens_per_step=8)
    engine = Engine(model, 4, 64, options=options)
    engine.start_generation()
    scheduler = engine.scheduler
    params = SamplingParams(temperature=0.9, max_new_tokens=5, seed=1, ignore_eos=True)
    sub = engine.submission(PROMPTS[:2], params)
    scheduler.add(sub)
    scheduler.step()  # the prompts alone: their rows' first tokens queued, not read
    assert len(scheduler.rows) == 2 and scheduler.pending is not None and not scheduler.drains
    while not sub.done:
        scheduler.step()
    assert scheduler.drains == 0
    expected = _engine(model).generate(PROMPTS[:2], params)
    _assert_same(sub.results, expected)
