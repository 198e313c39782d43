"""What the training-to-rollout reshard moves, from the layouts alone (no processes): each
rank's training block and rollout block of every parameter (blocks.py) and the bytes each
rank sends, receives and keeps. The memory plan prices a sync with it; engine/reshard.py
moves exactly these blocks (its run reports the same numbers, checked by a test)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.parallel.blocks import (
    PACKED_EXPERTS,
    SECTIONED_ROWS,
    VISION_PREFIX,
    Block,
    as_pieces,
    deltanet_sections,
    fsdp_block,
    numel,
    rollout_pieces,
    rollout_shard_dim,
    shard_dim,
    tensor_parallel_block,
    transfer_plan,
)
from hybridflow.parallel.layout import Layout, coordinates


def parameter_shapes(arch: ModelArchitecture) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every parameter of the decoder, in the model's order, read off
    the model built on the meta device (no memory), so every layer kind is exact (MLA's
    projections, GPT-OSS's sinks and biased experts, DeepSeek's shared experts); a tied
    lm_head is the embedding (not repeated). A sparse layer's MLP is its router and its
    packed experts (models/moe.py, the in-memory names the trainer holds)."""
    import torch

    from hybridflow.models.llama import CausalLM

    with torch.device("meta"):
        model = CausalLM(arch)
    # a vision-language model's encoder is left out: frozen (actor.freeze_vision_tower, the
    # default) it never changes (the tensor-parallel rollout copies it once and no sync moves
    # it: workers/rollout_tp.copy_frozen_encoder), and trained it is ~1% of the bytes (0.7 B
    # of the 72B's), whole on every rank (blocks.shard_dim)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()
            if not name.startswith(VISION_PREFIX)]  # fmt: skip


def training_blocks(name: str, shape: tuple[int, ...], layout: Layout) -> list[Block | None]:
    """Per rank, its block of parameter ``name`` in a training layout: the tensor-parallel
    shard (Megatron's split) cut in dim-0 chunks by FSDP2 over dp × sp (fully_shard on the
    layout's fsdp group)."""
    dim = shard_dim(name) if layout.tp > 1 else None
    fsdp = layout.size("fsdp")
    blocks = []
    for rank in range(layout.world):
        where = coordinates(layout, rank)
        block = tensor_parallel_block(shape, dim, where.get("tp", 0), layout.tp)
        blocks.append(fsdp_block(block, where.get("fsdp", 0), fsdp) if fsdp > 1 else block)
    return blocks


def rollout_blocks(name: str, shape: tuple[int, ...], layout: Layout, split_experts: bool = True,
                   sections: tuple[int, ...] | None = None) -> list[Block | tuple[Block, ...]]:  # fmt: skip
    """Per rank, its block of parameter ``name`` in a rollout layout (each replica whole); a
    packed expert tensor: the rank's whole experts when ``split_experts`` (the experts
    split over the tensor-parallel ranks, engine/tensor_parallel.py, or over the ``ep``
    ranks of several replicas when ep > tp, engine/expert_spread.py), else all of them.
    Gated DeltaNet's in_proj_qkv and conv taps: the rank's pieces, one a section of
    ``sections`` (blocks.rollout_pieces; blocks.deltanet_sections of the model)."""
    dim = rollout_shard_dim(name, split_experts)
    spread = dim is not None and name.endswith(PACKED_EXPERTS) and layout.ep > layout.tp
    blocks = []
    for rank in range(layout.world):
        at = coordinates(layout, rank)
        if spread:
            blocks.append(tensor_parallel_block(shape, dim, at["ep"], layout.ep))
            continue
        pieces = rollout_pieces(name, shape, at.get("tp", 0), layout.tp, split_experts, sections)
        blocks.append(pieces[0] if len(pieces) == 1 else pieces)
    return blocks


@dataclass(frozen=True)
class ReshardTraffic:
    """Bytes of one weight sync, per rank (the largest over ranks) and in all."""

    received: int
    """The most one rank receives."""
    sent: int
    """The most one rank sends."""
    kept: int
    """The least of its rollout shard a rank copies from its own training shard."""
    rollout_shard: int
    """The most one rank's rollout shard holds (its engine's weights)."""
    total_moved: int
    """Sent over all ranks."""
    gathered: int
    """What one rank receives when it all-gathers every full tensor instead (a whole copy)."""


def reshard_traffic(arch: ModelArchitecture, train: Layout, rollout: Layout,
                    element_bytes: int = 2, split_experts: bool = True) -> ReshardTraffic:  # fmt: skip
    """The bytes one training-to-rollout sync moves (both layouts over the same ranks: the
    colocated hybrid engine), in the rollout's dtype (``element_bytes``). Parameters of one
    shape and split move alike, so each kind is planned once and counted as often as it
    occurs (80 layers of a 70B model: 9 kinds)."""
    if train.world != rollout.world:
        raise ValueError(f"the reshard runs over one set of ranks: training {train.world}, "
                         f"rollout {rollout.world}")  # fmt: skip
    world = train.world
    received, sent, kept, shard = ([0] * world for _ in range(4))
    gathered = 0
    kinds: dict[tuple, list] = {}
    if train.ep > 1:
        raise ValueError("reshard_traffic plans training layouts without expert parallelism")
    for name, shape in parameter_shapes(arch):
        # a sectioned tensor's pieces depend on its name, not only its split dimension
        kind = (shape, shard_dim(name), rollout_shard_dim(name, split_experts),
                name.endswith(SECTIONED_ROWS))  # fmt: skip
        kinds.setdefault(kind, [name, 0])[1] += 1
    sections = deltanet_sections(arch)
    for (shape, *_), (name, count) in kinds.items():
        sources = training_blocks(name, shape, train)
        dests = [as_pieces(pieces) for pieces in
                 rollout_blocks(name, shape, rollout, split_experts, sections)]  # fmt: skip
        for piece in range(len(dests[0])):
            for move in transfer_plan(sources, [pieces[piece] for pieces in dests]):
                size = numel(move.block) * element_bytes * count
                if move.source == move.dest:
                    kept[move.dest] += size
                else:
                    received[move.dest] += size
                    sent[move.source] += size
        for rank, pieces in enumerate(dests):
            shard[rank] += sum(numel(block) for block in pieces) * element_bytes * count
        own = max(numel(b) for b in sources if b is not None)
        gathered += (numel(tuple((0, s) for s in shape)) - own) * element_bytes * count
    return ReshardTraffic(max(received), max(sent), min(kept), max(shard), sum(sent), gathered)
