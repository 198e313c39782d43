"""The paged KV cache (kv_cache.py, blocks.py, paging.py) on CPU, fp32: the same tokens and
log-probs as the slot cache, prompts' full blocks shared by their samples, admission by free
blocks, preemption that keeps every token, and kept KV for the next turn."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.cache.blocks import BlockPool

EAGER = dict(decode_backend="torch", cuda_graphs=False)
# lengths: 18 (one full block of 16 and a partial one), 2, 32 (two full blocks), 1
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], list(range(60, 92)), [12]]


def _generate(model, params, block_size=None, budget=None, batch=12, **options):
    engine = Engine(model, max_batch_size=batch, max_seq_len=96, memory_budget=budget,
                    options=EngineOptions(**EAGER, kv_block_size=block_size, **options))  # fmt: skip
    return engine, engine.generate(PROMPTS, params)


def _block_bytes(engine) -> int:
    return engine.cache.keys[:, 0].numel() * engine.cache.keys.element_size() * 2


def test_paged_samples_the_same_tokens_and_logprobs_as_the_slot_cache(model):
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=40, seed=3, ignore_eos=True)
    _, slot = _generate(model, params)
    engine, paged = _generate(model, params, block_size=16)
    assert [c.token_ids for c in paged] == [c.token_ids for c in slot]
    for a, b in zip(paged, slot):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    pool = engine.blocks
    assert pool.free_blocks == pool.num_blocks  # every block back once the call ended
    engine.scheduler.paging.sync_table()  # what the next kernel to read it would see
    assert engine.cache.block_table.eq(pool.scratch_block).all()


def test_samples_share_their_prompts_full_blocks():
    pool = BlockPool(num_blocks=10, block_size=16, num_slots=4, blocks_per_slot=4)
    assert pool.grow(0, 40)  # 3 blocks: [0, 16), [16, 32), [32, 40)
    copies = pool.share(0, 1, 40)
    assert pool.tables[1][:2] == pool.tables[0][:2] and pool.tables[1][2] != pool.tables[0][2]
    assert copies == ([pool.tables[0][2]], [pool.tables[1][2]])  # the partial block is copied
    assert pool.share(0, 2, 32) == ([], [])  # whole blocks only: nothing to copy
    assert pool.free_blocks == 10 - 4
    pool.release(0)  # the shared blocks stay with slots 1 and 2
    assert pool.free_blocks == 10 - 3
    pool.release(1)
    pool.release(2)
    assert pool.free_blocks == 10
    slots, indices, blocks = pool.pending_updates()  # the last write of an entry wins
    assert blocks.eq(pool.scratch_block).all() and pool.pending_updates() is None
    assert len(set(zip(slots.tolist(), indices.tolist()))) == len(slots)


def test_a_full_pool_refuses_to_grow_without_taking_anything():
    pool = BlockPool(num_blocks=3, block_size=16, num_slots=2, blocks_per_slot=4)
    assert pool.grow(0, 33)  # 3 blocks
    assert not pool.grow(1, 1) and pool.tables[1] == [] and pool.free_blocks == 0
    assert pool.share(0, 1, 20) is None and pool.tables[1] == []


def test_preempted_requests_resume_with_identical_tokens(model):
    """A budget of 14 blocks for 12 sequences that grow to 3-5 blocks each: the newest are
    preempted, prefilled again later, and sample exactly what an unconstrained run does."""
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=40, seed=3, ignore_eos=True)
    probe, expected = _generate(model, params, block_size=16)
    engine, got = _generate(model, params, block_size=16, budget=_block_bytes(probe) * 15)
    assert engine.cache.num_blocks == 14
    assert engine.scheduler.paging.preemptions > 0
    # each resumed request prefilled its prompt and tokens again (counted, like prompts)
    assert engine.prefill_tokens > probe.prefill_tokens
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_at_one_budget_paged_admission_decodes_more_rows_together(model):
    """Short responses in a cache sized for 4 slots of max_seq_len: the slot cache decodes 4
    rows at a time, the paged one admits by free blocks and runs more."""
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=8, seed=3, ignore_eos=True)
    slot_engine = Engine(model, 12, 96, options=EngineOptions(**EAGER, kv_block_size=None))
    slot_engine.generate(PROMPTS[:1], params)
    budget = slot_engine.cache.keys[:, 0].numel() * 4 * 2 * 5  # 4 slots + scratch
    slot, slot_out = _generate(model, params, budget=budget)
    paged, paged_out = _generate(model, params, block_size=16, budget=budget)
    assert slot.num_slots == 4
    mean_rows = lambda e: e.scheduler.decoded_rows / e.scheduler.decode_steps  # noqa: E731
    assert mean_rows(paged) > 2 * mean_rows(slot)
    assert [c.token_ids for c in paged_out] == [c.token_ids for c in slot_out]


def test_kept_kv_continues_in_its_blocks(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    deltas = [[7, 8, 9], [11], [3, 4, 5, 6, 7, 8, 9, 10], [44, 45]]

    def two_turns(block_size, reuse):
        engine = Engine(model, 8, 96, options=EngineOptions(**EAGER, kv_block_size=block_size))
        first = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4], keep=reuse)
        held = engine.blocks.num_blocks - engine.blocks.free_blocks if engine.blocks else 0
        prompts = [p + c.token_ids + d for p, c, d in zip(PROMPTS, first, deltas)]
        handles = [c.kv_handle for c in first] if reuse else None
        before = engine.prefill_tokens
        second = engine.generate(prompts, params, seeds=[5, 6, 7, 8], reuse=handles)
        return engine, second, held, engine.prefill_tokens - before

    _, full, _, _ = two_turns(None, False)
    engine, kept, held, prefilled = two_turns(16, True)
    assert [c.token_ids for c in kept] == [c.token_ids for c in full]
    # turn 1's blocks stayed with their handles: 18+5, 2+5, 32+5, 1+5 positions
    assert held == 2 + 1 + 3 + 1
    assert prefilled == sum(len(d) + 1 for d in deltas)  # only the new tokens
    assert engine.blocks.free_blocks == engine.blocks.num_blocks  # turn 2 kept nothing


def test_block_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="kv_block_size"):
        EngineOptions(kv_block_size=24).checked()
    with pytest.raises(ValueError, match="kv_block_size"):
        EngineOptions(kv_block_size=8).checked()


def test_block_pressure_evicts_kept_kv_before_it_preempts(model):
    """Turn 1 keeps the blocks of 4 conversations; a second call that needs the blocks evicts
    them (oldest first) rather than preempting its own requests, and samples as usual."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    probe = Engine(model, 8, 96, options=EngineOptions(**EAGER, kv_block_size=16))
    probe.generate(PROMPTS[:1], params, seeds=[0])
    budget = _block_bytes(probe) * 9  # 8 blocks and the scratch one
    engine = Engine(model, 8, 96, memory_budget=budget,
                    options=EngineOptions(**EAGER, kv_block_size=16))  # fmt: skip
    engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4], keep=True)
    assert len(engine.kept) == 4 and engine.blocks.free_blocks == 8 - 7
    others = [[1, 2, 3] * 6, [4, 5] * 9]
    got = engine.generate(others, params, seeds=[5, 6])
    assert engine.kept.evictions > 0 and engine.scheduler.paging.preemptions == 0
    expected = Engine(model, 8, 96, options=EngineOptions(**EAGER)).generate(others, params,
                                                                            seeds=[5, 6])  # fmt: skip
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]


def test_rows_that_cannot_outgrow_their_blocks_reserve_none(model):
    """max_seq_len of one block: the cache holds every sequence at full length (one block
    each), so all max_batch_size rows decode together and all stay kept, as in the slot
    cache (a growth block reserved per row admitted half and evicted the rest)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=0)
    prompts = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12]]
    engine = Engine(model, 4, 16, options=EngineOptions(**EAGER, kv_block_size=16))
    engine.generate(prompts, params, keep=True)
    assert engine.cache.num_blocks == 4 and len(engine.kept) == 4
    assert engine.scheduler.decoded_rows == 4 * engine.scheduler.decode_steps
