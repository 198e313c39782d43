"""Kept KV (kept.py): a finished request keeps its slot, the next turn prefills only its new
tokens and samples exactly what a full prefill of the whole conversation samples; release,
eviction under slot pressure and stale handles fall back to a full prefill (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.scheduling.kept import KeptKV

EAGER = EngineOptions(decode_backend="torch", cuda_graphs=False)
PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12]]
DELTAS = [[7, 8, 9], [11], [3, 4, 5, 6, 7, 8, 9, 10], [44, 45]]


def _two_turns(engine, reuse: bool):
    """Turn 1 on PROMPTS, turn 2 on prompt + turn 1's tokens + a delta; returns turn 2."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    first = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4], keep=reuse)
    second_prompts = [p + c.token_ids + d for p, c, d in zip(PROMPTS, first, DELTAS)]
    handles = [c.kv_handle for c in first] if reuse else None
    before = engine.prefill_tokens
    second = engine.generate(second_prompts, params, seeds=[5, 6, 7, 8], reuse=handles)
    return first, second, engine.prefill_tokens - before


def test_continuing_kept_kv_samples_as_a_full_prefill_and_prefills_only_new_tokens(model):
    full_first, full, full_prefill = _two_turns(Engine(model, 8, 64, options=EAGER), False)
    first, kept, kept_prefill = _two_turns(Engine(model, 8, 64, options=EAGER), True)
    assert [c.token_ids for c in first] == [c.token_ids for c in full_first]
    assert all(c.kv_handle is not None for c in first)
    assert [c.token_ids for c in kept] == [c.token_ids for c in full]
    for a, b in zip(kept, full):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    # turn 2 prefilled each delta plus the last token of turn 1 (never fed to the model)
    assert kept_prefill == sum(len(d) + 1 for d in DELTAS)
    assert full_prefill == sum(len(p) + 6 + len(d) for p, d in zip(PROMPTS, DELTAS))


def test_kept_slots_are_taken_from_the_pool_and_given_back(model):
    engine = Engine(model, 4, 64, options=EAGER)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=0)
    out = engine.generate(PROMPTS, params, keep=True)
    assert len(engine.kept) == 4 and len(engine.kept.slots()) == 4
    engine.release_kept([out[0].kv_handle, out[1].kv_handle, 12345])
    assert len(engine.kept) == 2
    engine.release_kept(c.kv_handle for c in out)
    assert len(engine.kept) == 0


def test_slot_pressure_evicts_the_oldest_and_stale_handles_prefill_in_full(model):
    """4 slots, all kept; a new call of 4 prompts evicts them (oldest first); continuing
    an evicted handle then prefills the whole conversation and still samples the same."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    engine = Engine(model, 4, 64, options=EAGER)
    first = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4], keep=True)
    engine.generate([[1, 2], [3, 4], [5, 6], [7, 8]], params, seeds=[9] * 4)  # needs the slots
    assert engine.kept.evictions == 4 and len(engine.kept) == 0
    second_prompts = [p + c.token_ids + d for p, c, d in zip(PROMPTS, first, DELTAS)]
    got = engine.generate(second_prompts, params, seeds=[5, 6, 7, 8],
                          reuse=[c.kv_handle for c in first])  # fmt: skip
    expected = Engine(model, 4, 64, options=EAGER).generate(second_prompts, params,
                                                             seeds=[5, 6, 7, 8])  # fmt: skip
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]


def test_a_handle_for_another_prefix_or_after_new_weights_is_not_used(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=0)
    engine = Engine(model, 4, 64, options=EAGER)
    out = engine.generate(PROMPTS[:1], params, keep=True)
    other = [9, 9, 9, 9, 9, 9, 9, 9, 9, 9]  # does not start with the kept tokens
    before = engine.prefill_tokens
    engine.generate([other], params, reuse=[out[0].kv_handle])
    assert engine.prefill_tokens - before == len(other)  # prefilled in full
    engine.load_weights([])  # weights (may have) changed: kept KV is stale
    assert len(engine.kept) == 0
    with pytest.raises(ValueError, match="one handle"):
        engine.generate(PROMPTS, SamplingParams(n=2), reuse=[None] * 4)


def test_kept_store_takes_only_proper_prefixes():
    store = KeptKV()
    handle = store.keep(3, [1, 2, 3])
    assert store.take(handle, [1, 2, 3]) is None  # nothing new to prefill: not a continuation
    assert store.take(handle, [1, 2, 4, 5]) is None
    assert store.take(handle, [1, 2, 3, 4]) == (3, 3)
    assert store.take(handle, [1, 2, 3, 4]) is None  # taken once
    first, second = store.keep(0, [1]), store.keep(1, [2])
    assert store.evict_oldest() == 0 and store.release([first, second]) == [1]


def test_a_continuation_pass_gets_its_bound_from_the_host(model):
    """The extend pass of kept turns is given max_len (the longest continued sequence):
    without it the pass reads position_ids.max() back from the device, a sync behind the
    decode steps queued on the GPU at every agent turn."""
    engine = Engine(model, 8, 64, options=EAGER)
    bounds = []
    extend = engine.extend

    def recording_extend(*args, **kwargs):
        bounds.append(kwargs.get("max_len"))
        return extend(*args, **kwargs)

    engine.extend = recording_extend
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    first = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4], keep=True)
    second = [p + c.token_ids + d for p, c, d in zip(PROMPTS, first, DELTAS)]
    engine.generate(second, params, seeds=[5, 6, 7, 8], reuse=[c.kv_handle for c in first])
    assert bounds == [max(len(p) for p in second)]
