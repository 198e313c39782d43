"""Mixed steps with static shapes (static_step.py, EngineOptions.graph_mixed_steps) on the
fused path: decode rows padded to their batch bucket, chunks padded to a token bucket,
the chunks' attention through the block table (kernels/chunk_attention.py). Run eagerly
here (the code a CUDA graph captures), they sample what the eager mixed steps sample, with
n = 2 samples sharing blocks, preemption and kept KV, and over an FP8 KV cache. fp32 tiny
model, on CPU under TRITON_INTERPRET=1 (tests/engine/test_mixed_graphs_gpu.py checks the
captured graphs)."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [100, 3, 8, 19, 23, 60, 61]]


@pytest.fixture(scope="module")
def model():
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    return model.requires_grad_(False)


def _engine(model, static: bool, slots=4, block=16, budget=None, kv="model") -> Engine:
    """static: the static fused step; else today's eager mixed step (torch backend); kv:
    the K/V cache's dtype (kv_cache_dtype)."""
    backend = dict(decode_backend="triton", graph_mixed_steps=True) if static else dict(
        decode_backend="torch", cuda_graphs=False)  # fmt: skip
    options = EngineOptions(**backend, kv_block_size=block, steps_per_sync=2,
                            max_prefill_tokens_per_step=8, kv_cache_dtype=kv)  # fmt: skip
    return Engine(model, slots, 64, memory_budget=budget, options=options)


def _assert_same(got, expected):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


def test_static_mixed_steps_sample_as_the_eager_mixed_steps(model):
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=8, seed=3, ignore_eos=True)
    budgets = [3, 3, 8, 8, 5, 5]  # the first prompt's rows leave early: the last joins
    expected = _engine(model, False).generate(PROMPTS, params, max_new_tokens=budgets)
    engine = _engine(model, True)
    got = engine.generate(PROMPTS, params, max_new_tokens=budgets)
    static = engine.scheduler.static_step
    assert static is not None and static.steps > 0  # chunks beside decode rows, static
    assert engine.blocks.free_blocks == engine.blocks.num_blocks
    _assert_same(got, expected)


def test_static_mixed_steps_over_an_fp8_kv_cache_sample_as_the_eager_ones(model):
    """e4m3 K/V with their scales (cache/fp8_kv.py): the static step's stores quantize and
    its decode and chunk attention dequantize as the eager passes over the same cache."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=6, seed=3, ignore_eos=True)
    budgets = [3, 3, 6, 6, 4, 4]
    expected = _engine(model, False, kv="fp8").generate(PROMPTS, params, max_new_tokens=budgets)
    engine = _engine(model, True, kv="fp8")
    got = engine.generate(PROMPTS, params, max_new_tokens=budgets)
    assert engine.cache.keys.dtype == torch.float8_e4m3fn
    assert engine.scheduler.static_step.steps > 0
    _assert_same(got, expected)


def test_static_mixed_steps_with_preemption_keep_every_token(model):
    """Five blocks of 16 for four sequences growing to one and two (16 and 21 tokens): the
    newest are preempted and come back as jobs, prefilled again in static steps beside the
    others."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=14, seed=5, ignore_eos=True)
    prompts = PROMPTS[1:]
    expected = _engine(model, False).generate(prompts, params)
    probe = _engine(model, True)
    keys = probe.num_slots and probe.cache.keys
    block_bytes = keys[:, 0].numel() * keys.element_size() * 2
    engine = _engine(model, True, budget=block_bytes * 6)
    got = engine.generate(prompts, params)
    assert engine.cache.num_blocks == 5 and engine.scheduler.paging.preemptions > 0
    assert engine.scheduler.static_step.steps > 0
    _assert_same(got, expected)


def _drive(engine, first, later):
    """`first` decoding, then `later` submitted (its jobs run beside first's rows)."""
    engine.start_generation()
    scheduler = engine.scheduler
    scheduler.add(first)
    scheduler.step()
    scheduler.add(later)
    while not (first.done and later.done):
        scheduler.step()
    scheduler.pending = None
    return first.results, later.results


@pytest.mark.parametrize("block", [16, None])
def test_kept_kv_continues_in_static_mixed_steps(model, block):
    """A second turn's continuations extend their kept slots in static steps beside a row
    that decodes meanwhile; each request samples what it samples alone (its seed's tokens)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    long = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    deltas = [[7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]

    eager = _engine(model, False, block=block)
    first = eager.generate(PROMPTS[:2], params, seeds=[1, 2], keep=True)
    prompts = [p + c.token_ids + d for p, c, d in zip(PROMPTS, first, deltas)]
    handles = [c.kv_handle for c in first]
    expected = eager.generate(prompts, params, seeds=[5, 6], reuse=handles)
    expected_row = eager.generate([PROMPTS[2]], long, seeds=[9])

    engine = _engine(model, True, block=block)
    turn = engine.generate(PROMPTS[:2], params, seeds=[1, 2], keep=True)
    _assert_same(turn, first)
    row = engine.submission([PROMPTS[2]], long, seeds=[9])
    continuations = engine.submission(prompts, params, seeds=[5, 6],
                                      reuse=[c.kv_handle for c in turn])  # fmt: skip
    before = engine.prefill_tokens
    got_row, got = _drive(engine, row, continuations)
    assert engine.prefill_tokens - before == len(PROMPTS[2]) + sum(len(d) + 1 for d in deltas)
    assert engine.scheduler.static_step.steps > 0
    _assert_same(got, expected)
    _assert_same(got_row, expected_row)


def test_padding_tokens_point_at_the_scratch_block_and_tiles_cover_each_chunk(model):
    """The inputs one static step uploads: the chunks' tokens packed from 0 at their cache
    blocks and offsets, the token bucket's padding at offset 0 of the scratch block (the
    only K/V it writes), each finished job's last token, the tiles' chunks."""
    from hybridflow.engine.scheduling.view import PrefillJob

    engine = _engine(model, True)
    engine.start_generation()
    scheduler, static = engine.scheduler, engine.scheduler.static_step
    sequence = list(range(10, 30))
    scheduler.paging.grow([2, 1], [20, 3])
    jobs = [PrefillJob([], [2], sequence, 15), PrefillJob([], [1], [7, 8, 9], 0)]
    chunks = [(jobs[0], 15, 5), (jobs[1], 0, 3)]
    static._upload(scheduler.paging, chunks, [0, 1], 8)
    ids, positions, entries, offsets, slots, ends, tiles = static._views(8)
    assert ids.tolist() == [25, 26, 27, 28, 29, 7, 8, 9]
    assert positions.tolist() == [15, 16, 17, 18, 19, 0, 1, 2]
    table = scheduler.paging.pool.table_array
    assert entries.tolist() == [table[2, 0]] + [table[2, 1]] * 4 + [table[1, 0]] * 3
    assert offsets.tolist() == [15, 0, 1, 2, 3, 0, 1, 2]
    assert slots.tolist() == [2] * 5 + [1] * 3
    assert ends.tolist()[:2] == [4, 7]
    assert [tuple(t) for t in tiles.tolist() if t[2] > t[1]] == [(2, 0, 5), (1, 5, 8)]
    static._upload(scheduler.paging, chunks[1:], [], 8)  # fewer tokens: the rest is padding
    ids, positions, entries, offsets, slots, ends, tiles = static._views(8)
    assert entries.tolist()[3:] == [engine.cache.num_blocks] * 5 and offsets.tolist()[3:] == [0] * 5
    assert ids.tolist()[3:] == [0] * 5 and positions.tolist()[3:] == [0] * 5
    assert slots.tolist()[3:] == [engine.state.scratch_slot] * 5
    assert [tuple(t) for t in tiles.tolist() if t[2] > t[1]] == [(1, 0, 3), (-1, 3, 8)]
    static._upload(None, [], [], 8)  # a warm-up's step (capture_all): padding only
    assert [tuple(t) for t in static._views(8)[-1].tolist() if t[2] > t[1]] == [(-1, 0, 8)]
