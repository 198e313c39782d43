"""Decode attention through a paged cache's block table (kernels/attention.py `PAGE`,
shared_prefix.py) against the same K/V in a slot cache: the same outputs and the same
writes, for a block smaller than the tile (a table lookup per position) and blocks the tiles
fit in (one lookup a tile, tiles aligned), with sequence splits and shared prefixes."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

from hybridflow.engine.kernels.shared_prefix import group_table

pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []
SEQ, KV_HEADS, HEADS, DIM = 128, 2, 6, 16


@pytest.fixture(scope="module")
def device():
    return triton_test_device()  # skips without CUDA or TRITON_INTERPRET=1


def _paged(slot_cache: torch.Tensor, block: int, generator) -> tuple:
    """The slot cache's [slots, SEQ, kv, D] in random blocks -> (paged [blocks + 1, block,
    kv, D], table int32 [slots, SEQ / block]); the last block is scratch."""
    slots, per_slot = slot_cache.shape[0], SEQ // block
    order = torch.randperm(slots * per_slot, generator=generator)
    paged = torch.zeros(slots * per_slot + 1, block, *slot_cache.shape[2:],
                        device=slot_cache.device)  # fmt: skip
    paged[order] = slot_cache.reshape(slots * per_slot, block, *slot_cache.shape[2:])
    table = order.view(slots, per_slot).to(torch.int32).to(slot_cache.device)
    return paged, table


def _unpaged(paged: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return paged[table.long()].flatten(1, 2)


@pytest.mark.parametrize("block", [16, 64, 128])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_attention_equals_the_slot_cache(device, block, splits):
    from hybridflow.engine.kernels import attention
    from hybridflow.models.presets import preset_config
    from hybridflow.models.rope import rope_cos_sin

    generator = torch.Generator().manual_seed(block + splits)
    rows, slots = 5, 7
    keys, values = (torch.randn(slots, SEQ, KV_HEADS, DIM, generator=generator).to(device)
                    for _ in range(2))  # fmt: skip
    row_slots = torch.tensor([3, 0, 6, 1, 4], device=device)
    positions = torch.tensor([0, 17, 63, 64, 127], device=device)  # block edges included
    q = torch.randn(rows, HEADS, DIM, generator=generator).to(device)
    paged_k, table = _paged(keys, block, generator)
    paged_v = torch.zeros_like(paged_k)  # V in K's layout
    paged_v[table.long().flatten()] = values.reshape(-1, block, KV_HEADS, DIM)
    plain = attention.decode_attention(q, keys, values, row_slots, positions + 1, SEQ,
                                       splits=splits, autotune=False)  # fmt: skip
    paged = attention.decode_attention(q, paged_k, paged_v, row_slots, positions + 1, SEQ,
                                       splits=splits, autotune=False, table=table)  # fmt: skip
    torch.testing.assert_close(paged, plain, rtol=1e-5, atol=1e-5)
    # with RoPE and the new token's store: the same output, the same cache afterwards
    k_new, v_new = (torch.randn(rows, KV_HEADS, DIM, generator=generator).to(device)
                    for _ in range(2))  # fmt: skip
    cos, sin = rope_cos_sin(preset_config("tiny"), torch.arange(SEQ, device=device),
                            torch.float32)  # fmt: skip
    outs = []
    for caches, extra in (((keys.clone(), values.clone()), {}),
                          ((paged_k.clone(), paged_v.clone()), {"table": table})):  # fmt: skip
        out = attention.decode_attention_rope(q, k_new, v_new, cos, sin, positions, *caches,
                                              row_slots, SEQ, splits=splits, autotune=False,
                                              **extra)  # fmt: skip
        outs.append((out, *caches))
    (plain, kc, vc), (paged, pk, pv) = outs
    torch.testing.assert_close(paged, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(_unpaged(pk, table), kc) and torch.equal(_unpaged(pv, table), vc)


@pytest.mark.parametrize("block", [16, 64])
def test_paged_shared_prefix_attention_equals_the_slot_cache(device, block):
    """Groups of samples whose prompts are whole shared blocks in the paged cache (each
    member's table points at them), against the slot cache's copies."""
    from hybridflow.engine.kernels import attention

    generator = torch.Generator().manual_seed(block)
    prompts, prompt_len = [0, 0, 0, 1, 1], {0: 2 * block if block < 64 else 64, 1: 37}
    lengths = [prompt_len[p] for p in prompts]
    slots = [0, 1, 2, 3, 4]
    keys, values = (torch.randn(6, SEQ, KV_HEADS, DIM, generator=generator).to(device)
                    for _ in range(2))  # fmt: skip
    for row, prompt in enumerate(prompts):  # samples of a prompt hold identical prefixes
        lead = prompts.index(prompt)
        keys[row, : lengths[row]] = keys[lead, : lengths[row]]
        values[row, : lengths[row]] = values[lead, : lengths[row]]
    paged_k, table = _paged(keys, block, generator)
    paged_v = torch.zeros_like(paged_k)
    paged_v[table.long().flatten()] = values.reshape(-1, block, KV_HEADS, DIM)
    positions = torch.tensor([n + e for n, e in zip(lengths, [3, 9, 0, 20, 1])], device=device)
    groups, first = group_table(prompts, lengths, slots, capacity=5)
    shared = (first.to(device), groups.to(device))
    q = torch.randn(5, HEADS, DIM, generator=generator).to(device)
    slots_t = torch.tensor(slots, device=device)
    plain = attention.decode_attention(q, keys, values, slots_t, positions + 1, SEQ,
                                       shared=shared, autotune=False)  # fmt: skip
    paged = attention.decode_attention(q, paged_k, paged_v, slots_t, positions + 1, SEQ,
                                       shared=shared, autotune=False, table=table)  # fmt: skip
    torch.testing.assert_close(paged, plain, rtol=1e-5, atol=1e-5)
