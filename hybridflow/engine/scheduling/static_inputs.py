"""What the steps with static shapes share (static_step.py's mixed steps, speculative/
static_verify.py's verify passes): a bucket of decode rows (the state's first rows) beside
chunks of tokens packed from 0 and padded to a token bucket, every input of the chunks in one
device buffer filled by one pinned copy, the forward over both (mixed_forward.py), and the
capture of such a step as a CUDA graph in the decode runner's table.

A chunk is (slot, first position, count) and its token ids: a prompt's next tokens in a mixed
step, a row's draft tokens in a verify pass. A padding token sits at offset 0 of the scratch
block (paged) or slot, the only place it writes K/V, which no live sequence reads; its
attention tile has no slot (zeros written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from hybridflow.engine.kernels.chunk_attention import chunk_tiles

if TYPE_CHECKING:
    from hybridflow.engine.scheduling.paging import Paging
    from hybridflow.engine.scheduling.view import EngineView

FIELDS = ("ids", "positions", "entries", "offsets", "slots")  # per chunk token


class ChunkViews(NamedTuple):
    """The device buffer's fields for one token bucket."""

    ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens] cache positions (padding: 0)
    entries: torch.Tensor  # [tokens] cache entry (block or slot) the K/V goes to
    offsets: torch.Tensor  # [tokens] offset in it
    slots: torch.Tensor  # [tokens] each token's slot (padding: the scratch slot)
    keep: torch.Tensor  # [keep size] the step's own index field (what each step keeps)
    tiles: torch.Tensor  # [tiles, 3] chunk_tiles' table


class StaticInputs:
    """The device buffer of a static step's chunks, and its two pinned staging buffers
    (alternating: a step's copy may still be in flight while the next one is filled).
    tiles: the tile count of each token bucket (chunk_attention.tile_count); keep_size: the
    length of the keep field."""

    def __init__(self, engine: EngineView, tiles: dict[int, int], keep_size: int,
                 per_tile: int):  # fmt: skip
        self.tiles, self.per_tile = tiles, per_tile
        top = max(tiles)
        self.sizes = [top] * len(FIELDS) + [keep_size, 3 * max(tiles.values())]
        total = sum(self.sizes)
        device = engine.device
        self.buffer = torch.zeros(total, dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self.staging = [torch.zeros(total, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0
        cache = engine.cache
        # a padding token's K/V: offset 0 of the scratch block (paged) or slot
        self.scratch = cache.num_blocks if cache.paged else cache.scratch_slot
        self.scratch_slot = engine.state.scratch_slot

    def fill(self, paging: Paging | None, slots: np.ndarray, starts: np.ndarray,
             counts: np.ndarray, ids, keep: np.ndarray, tokens: int) -> np.ndarray:  # fmt: skip
        """Chunks (their slots, first positions, token counts [C] int64, and their ids packed
        back to back) padded to `tokens`, and the keep field, into the device buffer (one
        copy; paging: the scheduler's, None for a slot cache). -> each chunk's first token
        index [C]."""
        turn = self.turn = 1 - self.turn
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()  # its last copy (two steps ago) read it: long done
        host = self.staging[turn].numpy()
        token_ids, positions, entries, offsets, token_slots, kept, tiles = np.split(
            host, np.cumsum(self.sizes)[:-1]
        )
        used = int(counts.sum())
        firsts = np.cumsum(counts) - counts
        token_ids[:used] = ids
        positions[:used] = np.arange(used) - np.repeat(firsts - starts, counts)
        token_slots[:used] = np.repeat(slots, counts)
        if paging is not None and used:
            entries[:used], offsets[:used] = paging.pool.locate(token_slots[:used],
                                                                positions[:used])  # fmt: skip
        else:
            entries[:used], offsets[:used] = token_slots[:used], positions[:used]
        token_ids[used:tokens], positions[used:tokens] = 0, 0
        entries[used:tokens], offsets[used:tokens] = self.scratch, 0
        token_slots[used:tokens] = self.scratch_slot
        kept[:] = 0
        kept[: len(keep)] = keep
        table = chunk_tiles(firsts, counts, slots, tokens, self.per_tile, self.tiles[tokens])
        tiles[: table.size] = table.reshape(-1)
        self.buffer.copy_(self.staging[turn], non_blocking=True)
        if self.copied[turn] is not None:
            self.copied[turn].record()
        return firsts

    def views(self, tokens: int) -> ChunkViews:
        """The device buffer's fields for a token bucket (fixed addresses: a graph reads them)."""
        parts = list(self.buffer.split(self.sizes))
        per_token = [part[:tokens] for part in parts[: len(FIELDS)]]
        return ChunkViews(*per_token, parts[len(FIELDS)],
                          parts[-1][: 3 * self.tiles[tokens]].view(-1, 3))  # fmt: skip


def static_forward(engine: EngineView, forward, bucket: int, views: ChunkViews,
                   keep: torch.Tensor, rotate_chunks: bool = False) -> torch.Tensor:  # fmt: skip
    """The forward of rows [0, bucket) of the decode state (one token each, at its position)
    beside the chunks' tokens (views) -> the logits of the tokens `keep` indexes [len(keep),
    V] (rows first, then the chunks' tokens from index `bucket`). rotate_chunks: chunk tokens
    turn by their slot's rotary shift too (a row's drafts continue its sequence; a prompt's
    chunk in a mixed step has none)."""
    state, cache = engine.state, engine.cache
    row_slots, row_positions = state.row_slots[:bucket], state.positions[:bucket]
    row_entries, row_offsets = cache.locate(row_slots, row_positions)
    return forward(
        engine.model, cache, engine.rope, torch.cat([state.tokens[:bucket], views.ids]),
        torch.cat([row_positions, views.positions]),
        (torch.cat([row_entries, views.entries]), torch.cat([row_offsets, views.offsets])),
        row_slots, keep, views.tiles, chunk_slots=views.slots if rotate_chunks else None,
    )  # fmt: skip


@dataclass
class StepGraph:
    """A captured static step (kept in the decode runner's graph table, so dropped with its
    graphs: a sampling mode gone, a parameter moved)."""

    graph: torch.cuda.CUDAGraph

    def replay(self) -> None:
        self.graph.replay()


def drop_step_graphs(runner, kind: str) -> None:
    """Drop the runner's graphs of static steps of `kind` ("mixed", "verify"): a graph reads
    the buffers of the step that captured it, and a new step (a new scheduler, as after a
    call that failed: Engine._reset_scheduler) has buffers of its own."""
    for key in [key for key in runner.graphs if isinstance(key[0], tuple) and key[0][0] == kind]:
        del runner.graphs[key]


def capture_step(runner, state, step) -> StepGraph:
    """`step` (no arguments; it reads fixed addresses only) captured in the runner's pool.
    Its warm-up (compilation, cuBLAS workspaces) runs it for real: the row state is restored
    after, and its cache writes are the ones the replay makes again."""
    snapshot = [field.clone() for field in state._row_fields]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
            for field, saved in zip(state._row_fields, snapshot):
                field.copy_(saved)
    torch.cuda.current_stream().wait_stream(stream)
    if runner.pool is None:
        runner.pool = torch.cuda.graph_pool_handle()
    captured = torch.cuda.CUDAGraph()
    # thread_local: as the decode graphs' (graphs.py)
    with torch.cuda.graph(captured, pool=runner.pool, capture_error_mode="thread_local"):
        step()
    return StepGraph(captured)
