"""Routing records read back beside a decode chunk (GPU): the reader's gather runs on a side
stream while the default stream is still decoding, so the slots it gathers must reach the
device on that side stream, not behind the chunk."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.cache.kv_cache import KVCache, RouteSpec
from hybridflow.engine.scheduling.routes import RouteReader

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

BLOCK = 4
SLOTS = 4
PER_SLOT = 4  # blocks of a slot: 16 positions


def paged_cache_with_records(device: torch.device) -> KVCache:
    """A paged cache whose slot s owns blocks [4s, 4s + 4), every position of its routing
    record holding s + 1."""
    blocks = SLOTS * PER_SLOT
    kv = torch.zeros(1, blocks + 1, BLOCK, 1, 8, dtype=torch.bfloat16, device=device)
    table = torch.full((SLOTS + 1, PER_SLOT), blocks, dtype=torch.int32, device=device)
    table[:SLOTS] = torch.arange(blocks, dtype=torch.int32, device=device).view(SLOTS, PER_SLOT)
    routes = RouteSpec(sparse_layers=2, top_k=2, num_experts=8).allocate(blocks + 1, BLOCK, device)
    for slot in range(SLOTS):
        routes[slot * PER_SLOT : (slot + 1) * PER_SLOT] = slot + 1
    return KVCache(kv, kv.clone(), table, BLOCK * PER_SLOT, routes)


def test_a_record_read_while_a_chunk_decodes_is_the_requested_slots():
    device = torch.device("cuda")
    cache = paged_cache_with_records(device)
    reader = RouteReader(cache, device)
    assert int(reader.read([3], [16])[0].max()) == 4  # warm: pinned buffers, the side stream
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        # the memory a fresh index of this pool gets first holds slot 0, a valid slot other
        # than the one asked for: a gather that ran before its index landed reads slot 0's
        poison = torch.zeros(64, dtype=torch.int64, device=device)
        written = torch.cuda.Event()
        written.record()  # the last snapshot's event: every record above is written
        torch.cuda._sleep(2_000_000_000)  # the chunk being decoded (~1 s of GPU time)
        del poison
        records = reader.read([2], [13], after=written)
    torch.cuda.synchronize()
    assert records[0].shape == (13, 2, 2)
    assert (records[0] == 3).all(), f"slot 2's record holds 3, read {set(records[0].flat)}"
