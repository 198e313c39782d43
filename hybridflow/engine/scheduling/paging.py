"""The scheduler's side of a paged KV cache: how many blocks an admission needs, the blocks of
admitted prompts (shared by their samples), where the tokens of a prefill or extend pass go,
and the device block table kept in step with the host's (blocks.BlockPool).

The preemption policy lives in the scheduler (scheduler.py, `_make_room`): when the rows of the
next chunk of decode steps need more blocks than are free, kept KV is evicted first, then the
newest requests are preempted: their blocks freed, their tokens kept, their prompt and tokens
prefilled again when blocks are free (`resume`).
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.engine.cache.blocks import BlockPool
from hybridflow.engine.cache.kv_cache import KVCache
from hybridflow.engine.host import upload


class Paging:
    def __init__(self, pool: BlockPool, cache: KVCache, device: torch.device):
        self.pool, self.cache, self.device = pool, cache, device
        self.preemptions = 0  # requests preempted so far (a counter, like the scheduler's)

    @property
    def free_blocks(self) -> int:
        return self.pool.free_blocks

    def prompt_blocks(self, length: int, first: bool) -> int:
        """Blocks an admitted request's prompt takes: all of them for a prompt's first sample,
        the partial last block only for the others (they share the full ones)."""
        if first:
            return self.pool.blocks_for(length)
        return int(length % self.pool.block_size != 0)

    def place(self, slots: list[int], firsts: list[int], group: list[int], lengths: list[int]):
        """Blocks for one admission's requests (slots[i]; group[i] its unique prompt, firsts
        that prompt's first request, lengths[prompt]): the first request's slot gets the
        prompt's blocks, the others share them. -> the partial blocks' copies as (source
        entries, source offsets, destination entries, destination offsets) CPU tensors; None
        when nothing is copied. The caller checked the blocks are free (prompt_blocks)."""
        first_slot = {g: slots[i] for g, i in enumerate(firsts)}
        src_blocks, dst_blocks, counts = [], [], []
        for i, slot in enumerate(slots):
            g = group[i]
            if first_slot[g] == slot:
                grown = self.pool.grow(slot, lengths[g])
                assert grown, "place: the caller counted the prompt's blocks as free"
                continue
            copy = self.pool.share(first_slot[g], slot, lengths[g])
            assert copy is not None
            if copy[0]:
                src_blocks += copy[0]
                dst_blocks += copy[1]
                counts.append(lengths[g] % self.pool.block_size)
        if not counts:
            return None
        counts_t = torch.tensor(counts)
        offsets = torch.cat([torch.arange(c) for c in counts])
        src = torch.repeat_interleave(torch.tensor(src_blocks), counts_t)
        dst = torch.repeat_interleave(torch.tensor(dst_blocks), counts_t)
        return src, offsets, dst, offsets

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Host (entries, offsets) of positions of slots (CPU int64 tensors)."""
        blocks, offsets = self.pool.locate(slots.numpy(), positions.numpy())
        return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(offsets)

    def sync_table(self) -> None:
        """Write the host's changed table entries into the device table (queued, no sync):
        before any kernel reads it through a row's slot."""
        updates = self.pool.pending_updates()
        if updates is None:
            return
        slots, indices, blocks = upload(self.device, *updates)
        self.cache.block_table[slots, indices] = blocks.to(torch.int32)

    def missing(self, slots: list[int], lengths: list[int]) -> int:
        return sum(self.pool.missing(s, n) for s, n in zip(slots, lengths))

    def grow(self, slots: list[int], lengths: list[int]) -> None:
        for slot, length in zip(slots, lengths):
            grown = self.pool.grow(slot, length)
            assert grown, "grow: the caller counted the blocks as free"

    def release(self, slot: int) -> None:
        self.pool.release(slot)
