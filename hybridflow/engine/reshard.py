"""The 3D-HybridEngine reshard: a sharded trainer's parameters into a tensor-parallel
engine's, bucket by bucket, with no rank holding a whole copy of the model.

Each rank holds one block of every training parameter (an FSDP2 shard, of a tensor-parallel
shard when training is tensor-parallel) and needs one block of it in the engine (its
rollout tensor-parallel shard). parallel/blocks.transfer_plan lists who sends which
rectangle to whom; each bucket of parameters is then one all_to_all_single over the group:
a rank packs what it owes each other rank, receives what it is owed and copies it into its
engine's parameters. What its own training block already holds is copied locally and never
sent. Transient memory is one bucket's send and receive buffers (``bucket_bytes`` for the
rank that moves the most; a single parameter larger than that is a bucket of its own).

The plan is pure: every rank computes the same buckets from the same blocks, so the
collectives match without any exchange of sizes. The blocks each rank holds are read once
from the DTensors (their global offsets) and shared with one all_gather_object; they do not
change while the layouts do not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from hybridflow.parallel.blocks import Block, Transfer, as_pieces, numel, transfer_plan, whole


@dataclass
class ReshardStats:
    """What one reshard did on this rank."""

    buckets: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_kept: int = 0
    """Copied from this rank's own training block (no communication)."""
    peak_buffer_bytes: int = 0
    """The largest send + receive buffers of one bucket: the transient memory."""
    seconds: float = 0.0


def local_block(tensor: torch.Tensor) -> Block | None:
    """The block of the full tensor this rank holds: a DTensor's local shard at its global
    offset, or the whole of a plain tensor (None: an empty shard)."""
    if not hasattr(tensor, "to_local"):
        return whole(tuple(tensor.shape))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                          tensor.placements)  # fmt: skip
    if 0 in shape:
        return None
    return tuple((start, start + size) for start, size in zip(offset, shape))


class Adapter(NamedTuple):
    """A LoRA adapter on a weight: the weight moves as W + scale · B @ A (its rows of B are
    held where its rows of W are: FSDP2 chunks both by output rows). On a packed expert
    tensor W [E, out, in] the factors are per expert, A [E, r, in] and B [E, out, r], and
    FSDP2 chunks all three by experts (dim 0), so a rank merges its own experts alone."""

    lora_a: torch.Tensor  # [r, in] (a DTensor: gathered, r × in is small); experts: [E, r, in]
    lora_b: torch.Tensor  # [out, r]; experts: [E, out, r]
    scale: float


def merged_block(base: torch.Tensor, adapter: Adapter) -> torch.Tensor:
    """This rank's block of W + scale · B @ A in fp32 (the rows of its base shard), as
    learners/lora.merge_lora_stream merges whole tensors. Collective for a sharded A: every
    rank calls it for the same weights in the same order."""
    if adapter.lora_a.dim() == 3:  # per-expert factors: this rank's experts, bmm
        lora_a, lora_b = (t.to_local() if hasattr(t, "to_local") else t
                          for t in (adapter.lora_a, adapter.lora_b))  # fmt: skip
        delta = adapter.scale * torch.bmm(lora_b.float(), lora_a.float().to(lora_b.device))
        return base.float() + delta.to(base.device)
    lora_a = adapter.lora_a
    lora_a = lora_a.full_tensor() if hasattr(lora_a, "full_tensor") else lora_a
    lora_b = adapter.lora_b
    lora_b = lora_b.to_local() if hasattr(lora_b, "to_local") else lora_b
    delta = adapter.scale * (lora_b.float() @ lora_a.float().to(lora_b.device))
    return base.float() + delta.to(base.device)


def _slices(block: Block, within: Block) -> tuple[slice, ...]:
    """``block`` as index slices of the tensor holding ``within`` (block inside it)."""
    return tuple(slice(b0 - w0, b1 - w0) for (b0, b1), (w0, _) in zip(block, within))


@dataclass
class _Parameter:
    name: str
    source_block: Block | None
    target: torch.Tensor  # this rank's engine parameter
    target_block: Block
    transfers: list[Transfer] = field(default_factory=list)


class Resharder:
    """Moves ``sources`` (name -> a training parameter: a DTensor or a whole tensor) into
    ``targets`` (name -> the engine's parameter, this rank's block ``target_blocks[name]``
    of the full tensor) over ``group``, whose ranks index the blocks.

    A target held as several pieces (``target_blocks[name]`` a tuple of blocks stacked along
    its dim 0: Gated DeltaNet's in_proj_qkv and conv taps, parallel/blocks.rollout_pieces)
    is assembled piece by piece.

    Built once per pair of layouts (collective: every rank of the group, same names);
    ``run(sources)`` (collective too) moves their current values and returns what it did
    (the trainer's parameter objects are read again at every run: FSDP2 may have replaced
    their storage since)."""

    def __init__(self, sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
                 target_blocks: dict[str, Block], group=None,
                 bucket_bytes: int = 256 * 2**20):  # fmt: skip
        missing = sorted(set(targets) - set(sources))
        if missing:
            raise KeyError(f"reshard: the trainer has no parameter {missing[0]!r} "
                           f"({len(missing)} missing)")  # fmt: skip
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.bucket_bytes = bucket_bytes
        names = list(targets)
        mine = {name: (local_block(sources[name]), as_pieces(target_blocks[name]))
                for name in names}  # fmt: skip
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine, group=group)
        self.parameters = []
        for name in names:
            source_block, pieces = mine[name]
            row = 0  # a piece's first row in this rank's engine tensor (pieces stack on dim 0)
            for index, piece in enumerate(pieces):
                rows = piece[0][1] - piece[0][0]
                target = targets[name] if len(pieces) == 1 else targets[name].narrow(0, row, rows)
                entry = _Parameter(name, source_block, target, piece)
                entry.transfers = transfer_plan([blocks[name][0] for blocks in everyone],
                                                [blocks[name][1][index] for blocks in everyone])  # fmt: skip
                self.parameters.append(entry)
                row += rows
        self.buckets = self._buckets()

    def _traffic(self, entry: _Parameter) -> list[int]:
        """Elements each rank sends plus receives for this parameter."""
        load = [0] * self.world
        for move in entry.transfers:
            if move.source != move.dest:
                load[move.source] += numel(move.block)
                load[move.dest] += numel(move.block)
        return load

    def _buckets(self) -> list[list[_Parameter]]:
        """Consecutive parameters while no rank's send + receive buffers pass bucket_bytes."""
        buckets, current, load = [], [], [0] * self.world
        for entry in self.parameters:
            size = entry.target.element_size()
            extra = self._traffic(entry)
            if current and max(a + b for a, b in zip(load, extra)) * size > self.bucket_bytes:
                buckets.append(current)
                current, load = [], [0] * self.world
            current.append(entry)
            load = [a + b for a, b in zip(load, extra)]
        if current:
            buckets.append(current)
        return buckets

    @torch.no_grad()
    def run(self, sources: dict[str, torch.Tensor],
            adapters: dict[str, Adapter] | None = None) -> ReshardStats:  # fmt: skip
        """Move the current values of ``sources`` (the parameters given at construction);
        ``adapters``: the LoRA adapter of a weight, merged into it on the rank that sends it
        (per bucket: the merged blocks of one bucket at a time)."""
        stats = ReshardStats(buckets=len(self.buckets))
        start = time.perf_counter()
        local = {}
        for entry in self.parameters:
            tensor = sources[entry.name].detach()
            local[entry.name] = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        for bucket in self.buckets:
            merged = {entry.name: merged_block(local[entry.name], adapters[entry.name])
                      for entry in bucket if adapters and entry.name in adapters}  # fmt: skip
            self._move(bucket, {**local, **merged}, stats)
        stats.seconds = time.perf_counter() - start
        return stats

    def _move(self, bucket: list[_Parameter], local: dict[str, torch.Tensor],
              stats: ReshardStats) -> None:  # fmt: skip
        target = bucket[0].target
        outgoing = [[] for _ in range(self.world)]  # per destination: tensors to send
        incoming = [[] for _ in range(self.world)]  # per source: (entry, block) to receive
        for entry in bucket:
            for move in entry.transfers:
                if move.source == self.rank == move.dest:
                    piece = local[entry.name][_slices(move.block, entry.source_block)]
                    entry.target[_slices(move.block, entry.target_block)].copy_(piece)
                    stats.bytes_kept += numel(move.block) * entry.target.element_size()
                elif move.source == self.rank:
                    piece = local[entry.name][_slices(move.block, entry.source_block)]
                    piece = piece.to(device=target.device, dtype=target.dtype)
                    outgoing[move.dest].append(piece.reshape(-1))
                elif move.dest == self.rank:
                    incoming[move.source].append((entry, move.block))
        if not any(move.source != move.dest for entry in bucket for move in entry.transfers):
            return  # every rank's blocks were its own (the layouts coincide): no collective
        send_sizes = [sum(p.numel() for p in pieces) for pieces in outgoing]
        receive_sizes = [sum(numel(block) for _, block in pieces) for pieces in incoming]
        like = dict(dtype=target.dtype, device=target.device)
        send = torch.cat([p for pieces in outgoing for p in pieces]) if sum(send_sizes) else (
            torch.empty(0, **like))  # fmt: skip
        receive = torch.empty(sum(receive_sizes), **like)
        dist.all_to_all_single(receive, send, receive_sizes, send_sizes, group=self.group)
        offset = 0
        for pieces in incoming:
            for entry, block in pieces:
                count = numel(block)
                shape = tuple(stop - start for start, stop in block)
                part = receive[offset : offset + count].view(shape)
                entry.target[_slices(block, entry.target_block)].copy_(part)
                offset += count
        element = target.element_size()
        stats.bytes_sent += sum(send_sizes) * element
        stats.bytes_received += sum(receive_sizes) * element
        stats.peak_buffer_bytes = max(stats.peak_buffer_bytes,
                                      (send.numel() + receive.numel()) * element)  # fmt: skip
