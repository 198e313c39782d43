"""KV-cache slot and block planning: a budget given as a fraction counts the memory PyTorch's allocator
holds cached but unused as available (a colocated trainer leaves its freed blocks reserved)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.cache import sizing

GIB = 2**30


def test_a_fractional_budget_counts_cached_but_unused_allocator_memory(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 50 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * GIB)
    assert sizing.available_bytes(cuda) == 40 * GIB  # 10 free + 30 cached
    slots = sizing.plan_slots(10_000, GIB // 4, 0.5, cuda)
    assert slots == 20 * 4 - 1  # half of 40 GiB in 1/4-GiB slots, less the scratch slot
    assert sizing.plan_slots(10_000, GIB // 4, None, cuda, reserve_bytes=GIB) == 139


def test_on_cpu_and_with_bytes_the_budget_is_as_given():
    cpu = torch.device("cpu")
    assert sizing.plan_slots(64, 1000, None, cpu) == 64
    assert sizing.plan_slots(64, 1000, 0.5, cpu) == 64
    assert sizing.plan_slots(64, 1000, 10_000, cpu) == 9


def test_paged_blocks_are_what_the_budget_holds_capped_at_every_sequence_at_full_length():
    plan_blocks = sizing.plan_blocks
    cpu = torch.device("cpu")
    # 4 sequences of 100 positions in blocks of 16: at most 4 * 7 blocks are ever useful
    assert plan_blocks(4, 100, 16, 1000, None, cpu) == 28
    assert plan_blocks(4, 100, 16, 1000, 0.5, cpu) == 28  # a fraction: unlimited on CPU
    assert plan_blocks(4, 100, 16, 1000, 1000 * 11, cpu) == 10  # 10 and the scratch block
    with pytest.raises(ValueError, match="one sequence of max_seq_len=100 needs 7"):
        plan_blocks(4, 100, 16, 1000, 1000 * 7, cpu)
