"""Mixed steps captured as CUDA graphs (EngineOptions.graph_mixed_steps, scheduling/
static_step.py) sample what the eager mixed steps of the same fused engine sample, in fp32
on a tiny model: prompts joining decoding rows (n = 2 sharing blocks), preemption by a small
block budget, kept KV continued beside a decoding row, a slot cache, an FP8 KV cache; and a
bf16 step agrees to bf16 rounding.

    pytest -m gpu tests/engine/test_mixed_graphs_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [100, 3, 8, 19, 23, 60, 61], [12] * 30]


@pytest.fixture(scope="module")
def model():
    """std-0.3 weights: peaked logits, greedy far from ties."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.to("cuda")


def _engine(model, captured: bool, block=16, budget=None, slots=4, kv="model") -> Engine:
    options = EngineOptions(decode_backend="triton", kv_block_size=block, steps_per_sync=2,
                            max_prefill_tokens_per_step=16, graph_mixed_steps=captured,
                            kv_cache_dtype=kv)  # fmt: skip
    return Engine(model, slots, 96, memory_budget=budget, options=options)


def _assert_same(got, expected, atol=1e-4):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)


def _captured(engine) -> None:
    static = engine.scheduler.static_step
    assert static is not None and static.steps > 0 and static.captures > 0


@pytest.mark.parametrize("block", [16, None])
def test_captured_mixed_steps_sample_as_eager_mixed_steps(model, block):
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True)
    budgets = [3, 3, 12, 12, 6, 6, 9, 9]  # rows leave at different steps: prompts join
    expected = _engine(model, False, block).generate(PROMPTS, params, max_new_tokens=budgets)
    engine = _engine(model, True, block)
    got = engine.generate(PROMPTS, params, max_new_tokens=budgets)
    _captured(engine)
    _assert_same(got, expected)
    again = engine.generate(PROMPTS, params, max_new_tokens=budgets)  # graphs replayed
    _assert_same(again, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_captured_mixed_steps_over_an_fp8_kv_cache_sample_as_eager_ones(model, dtype):
    """e4m3 K/V with their scales: the captured steps' stores and attention (decode rows and
    chunks) against the eager fused steps over the same cache, whose extend attends through
    decode attention (fp32: the same tokens; bf16: the first tokens to rounding)."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True)
    budgets = [3, 3, 12, 12, 6, 6, 9, 9]
    if dtype == torch.bfloat16:
        params = SamplingParams(n=2, temperature=0, max_new_tokens=10, ignore_eos=True)
        half = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
        half.load_state_dict(model.state_dict())
        model = half.to("cuda", dtype)
    results = []
    for captured in (False, True):
        engine = _engine(model, captured, kv="fp8")
        results.append(engine.generate(PROMPTS, params, max_new_tokens=budgets))
        assert engine.cache.keys.dtype == torch.float8_e4m3fn
    _captured(engine)
    if dtype == torch.float32:
        _assert_same(results[1], results[0])
    else:
        for got, expected in zip(*results[::-1]):
            assert got.token_ids[0] == expected.token_ids[0]
            assert abs(got.logprobs[0] - expected.logprobs[0]) < 0.05


def test_warm_up_captures_the_mixed_graphs_that_the_steps_then_replay(model):
    """Engine.warm_up captures every (batch bucket, token bucket) mixed graph with padding
    rows and tokens only; the steps afterwards replay them (none captured) and sample as
    eager mixed steps do."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True)
    budgets = [3, 3, 12, 12, 6, 6, 9, 9]
    expected = _engine(model, False).generate(PROMPTS, params, max_new_tokens=budgets)
    engine = _engine(model, True)
    captured = engine.warm_up(params)
    static = engine.scheduler.static_step
    assert static.captures == len(static.buckets) * len(engine.runner.buckets)
    assert captured == static.captures + len(engine.runner.buckets)
    got = engine.generate(PROMPTS, params, max_new_tokens=budgets)
    assert static.captures == len(static.buckets) * len(engine.runner.buckets)
    assert static.steps > 0
    _assert_same(got, expected)


def test_captured_mixed_steps_with_preemption_keep_every_token(model):
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=5, ignore_eos=True)
    prompts = PROMPTS[:3]
    expected = _engine(model, False, slots=6).generate(prompts, params)
    probe = _engine(model, True, slots=6)
    keys = probe.num_slots and probe.cache.keys
    block_bytes = keys[:, 0].numel() * keys.element_size() * 2
    engine = _engine(model, True, budget=block_bytes * 13, slots=6)
    got = engine.generate(prompts, params)
    assert engine.cache.num_blocks == 12 and engine.scheduler.paging.preemptions > 0
    _captured(engine)
    _assert_same(got, expected)


def _drive(engine, first, later):
    """`first` decoding, then `later` submitted (its jobs run beside first's rows)."""
    engine.start_generation()
    scheduler = engine.scheduler
    with torch.cuda.device("cuda"):
        scheduler.add(first)
        scheduler.step()
        scheduler.add(later)
        while not (first.done and later.done):
            scheduler.step()
    scheduler.pending = None
    return first.results, later.results


def test_kept_kv_continues_in_captured_mixed_steps(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    long = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    deltas = [[7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [44] * 20]
    results = []
    for captured in (False, True):
        engine = _engine(model, captured, slots=6)
        first = engine.generate(PROMPTS[:3], params, seeds=[1, 2, 3], keep=True)
        prompts = [p + c.token_ids + d for p, c, d in zip(PROMPTS, first, deltas)]
        row = engine.submission([PROMPTS[3]], long, seeds=[9])
        turns = engine.submission(prompts, params, seeds=[5, 6, 7],
                                  reuse=[c.kv_handle for c in first])  # fmt: skip
        before = engine.prefill_tokens
        got_row, got = _drive(engine, row, turns)
        assert engine.prefill_tokens - before == len(PROMPTS[3]) + sum(len(d) + 1 for d in deltas)
        results.append(first + got + got_row)
        if captured:
            _captured(engine)
    _assert_same(results[1], results[0])


def test_bf16_captured_mixed_steps_agree_with_eager_to_rounding(model):
    """bf16: the eager step's chunks attend through FlashAttention, the captured step's
    through the paged chunk kernel; first tokens agree to bf16 rounding."""
    half = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    half.load_state_dict(model.state_dict())
    half = half.to("cuda", torch.bfloat16)
    greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    budgets = [3, 10, 8, 6]
    firsts = []
    for captured in (False, True):
        engine = _engine(half, captured, slots=2)
        out = engine.generate(PROMPTS, greedy, max_new_tokens=budgets)
        firsts.append([(c.token_ids[0], c.logprobs[0]) for c in out])
        if captured:
            _captured(engine)
    for (token, logprob), (ref_token, ref_logprob) in zip(firsts[1], firsts[0]):
        assert token == ref_token and abs(logprob - ref_logprob) < 0.05
