"""The host's bookkeeping of a paged KV cache (kv_cache.py): free blocks, how many slots use
each block, and every slot's block list, mirrored to the device's block table.

The scheduler asks for blocks as sequences grow (`grow`, before each chunk of decode steps
covers the positions the chunk will write), shares a prompt's full blocks with its other
samples (`share`: only the partial last block is copied), and gives a slot's blocks back when
its request ends (`release`). Changes to the tables are queued (`pending_updates`) and written
to the device table in one scatter before the next kernel reads it, without a sync.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, blocks_per_slot: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, ...
        self.users = [0] * num_blocks  # slots whose table holds each block
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        # the same tables as one array (the scratch block past each slot's blocks): locate()
        self.table_array = np.full((num_slots, blocks_per_slot), num_blocks, dtype=np.int64)
        self._updates: list[tuple[int, int, int]] = []  # (slot, index, block)

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, length: int) -> int:
        """Blocks that hold positions [0, length)."""
        return -(-length // self.block_size)

    def missing(self, slot: int, length: int) -> int:
        """Blocks `slot` still needs to hold positions [0, length)."""
        return max(0, self.blocks_for(length) - len(self.tables[slot]))

    def grow(self, slot: int, length: int) -> bool:
        """Give `slot` blocks up to position `length`; False (and nothing taken) when too few
        are free."""
        need = self.missing(slot, length)
        if need > len(self.free):
            return False
        table = self.tables[slot]
        for _ in range(need):
            block = self.free.pop()
            self.users[block] += 1
            self._set(slot, len(table), block)
            table.append(block)
        return True

    def _set(self, slot: int, index: int, block: int) -> None:
        self.table_array[slot, index] = block
        self._updates.append((slot, index, block))

    def share(self, source: int, slot: int, length: int) -> tuple[list[int], list[int]] | None:
        """`slot` (empty) takes `source`'s full blocks of positions [0, length) and a fresh
        block for the partial last one, if any. Returns the partial block's copy as
        (source block, fresh block) lists (empty when length fills whole blocks); None (and
        nothing changed) when no block is free for it."""
        assert not self.tables[slot], "share into an empty slot"
        full, partial = divmod(length, self.block_size)
        if partial and not self.free:
            return None
        table = self.tables[slot]
        for index, block in enumerate(self.tables[source][:full]):
            self.users[block] += 1
            self._set(slot, index, block)
            table.append(block)
        if not partial:
            return [], []
        block = self.free.pop()
        self.users[block] += 1
        self._set(slot, full, block)
        table.append(block)
        return [self.tables[source][full]], [block]

    def release(self, slot: int) -> None:
        """`slot` gives its blocks back (a block shared with other slots stays theirs); its
        table points at the scratch block again, so nothing reads or writes the freed blocks
        through it (a warm-up step moves rows past their positions: graphs.py)."""
        for index, block in enumerate(self.tables[slot]):
            self.users[block] -= 1
            if self.users[block] == 0:
                self.free.append(block)
            self._set(slot, index, self.scratch_block)
        self.tables[slot] = []

    def locate(self, slots: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, offsets) of positions of slots (int64 arrays, host), for the prefill and
        extend passes whose tokens the host lays out."""
        return self.table_array[slots, positions // self.block_size], positions % self.block_size

    def pending_updates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The table entries changed since the last call, as (slots, indices, blocks) CPU
        int64 tensors (the last change of an entry wins); None when nothing changed."""
        if not self._updates:
            return None
        latest = {(slot, index): block for slot, index, block in self._updates}
        self._updates.clear()
        keys = np.array(list(latest), dtype=np.int64).reshape(-1, 2)
        blocks = np.fromiter(latest.values(), dtype=np.int64, count=len(latest))
        return (torch.from_numpy(keys[:, 0].copy()), torch.from_numpy(keys[:, 1].copy()),
                torch.from_numpy(blocks))  # fmt: skip
