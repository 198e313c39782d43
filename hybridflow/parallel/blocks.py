"""Which rank holds which block of a parameter, and what a reshard moves: pure arithmetic.

A block is a rectangle of a parameter's full tensor, one [start, stop) per dimension. A
layout puts one block of each parameter on each rank: the training layout's FSDP2 shard
(dim-0 chunks, torch.chunk's sizes, of the tensor-parallel shard), the rollout's
tensor-parallel shard (Megatron's split: engine/tensor_parallel.shard_dim). The 3D-HybridEngine
reshard (HybridFlow, Sheng et al. 2024, §5) gives every rank its rollout block from the
training blocks that intersect it: :func:`transfer_plan` lists each (source rank, destination
rank, block); the part of a rank's rollout block its own training block holds never moves.
engine/reshard.py runs the plan; :func:`reshard_traffic` prices it for the memory plan.
"""

from __future__ import annotations

from dataclasses import dataclass

Block = tuple[tuple[int, int], ...]
"""[start, stop) per dimension of the full tensor."""

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# Gated DeltaNet (models/sharding/tensor_parallel.py): split by key heads with their value
# heads. Its input projections, conv taps and per-head decay parameters by rows (dim 0),
# out_proj by input columns; its gated norm (one weight a head dimension) whole.
DELTANET_ROWS = (".linear_attn.in_proj_qkv.weight", ".linear_attn.in_proj_z.weight",
                 ".linear_attn.in_proj_a.weight", ".linear_attn.in_proj_b.weight",
                 ".linear_attn.conv1d.weight", ".linear_attn.A_log", ".linear_attn.dt_bias")  # fmt: skip
DELTANET_COLUMNS = (".linear_attn.out_proj.weight",)
# ... of which in_proj_qkv's and the conv's rows run [q; k; v] over all heads: a rank's heads
# are its part of each of the three sections (deltanet_parallel.head_channels), not one range
SECTIONED_ROWS = (".linear_attn.in_proj_qkv.weight", ".linear_attn.conv1d.weight")
# A vision-language model's encoder (models/vision/): whole on every rank, in training's
# tensor parallelism and in the rollout's (it is small, ~1% of the 72B's weights, and runs
# once a prompt); its MLP's projections share the decoder's names, so it is told by prefix
VISION_PREFIX = "visual."


def shard_dim(name: str) -> int | None:
    """The dimension along which tensor parallelism splits parameter ``name`` (an HF name),
    Megatron's split (Shoeybi et al. 2019, §3): q/k/v and gate/up by output rows (whole
    heads), o_proj and down_proj by input columns, the embedding and lm_head by vocabulary
    rows; None: every rank holds all of it (norms, o_proj's bias, added after the sum, the
    vision encoder's parameters)."""
    if name.startswith(VISION_PREFIX):
        return None
    if name in VOCAB or name.endswith(DELTANET_ROWS):
        return 0
    if name.endswith(DELTANET_COLUMNS):
        return 1
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if module in COLUMN:
        return 0
    if module in ROW and kind == "weight":
        return 1
    return None


# A packed expert tensor [E, ...] (GPT-OSS's experts carry a bias [E, ...] each)
PACKED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj",
                  ".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj_bias")  # fmt: skip
# Per-head tensors of the other attention kinds, split with their heads in the rollout:
# GPT-OSS's sink logits [nh]; MLA's q up-projection [nh * (nope + rope), q_lora_rank] and
# k/v up-projection [nh * (nope + v), kv_lora_rank] (whole heads per rank). MLA's latent
# projection (kv_a_proj_with_mqa), q's down-projection and their norms are whole on every
# rank: every head reads the one latent.
HEAD_ROWS = (".self_attn.sinks", ".self_attn.q_b_proj.weight", ".self_attn.kv_b_proj.weight")


def rollout_shard_dim(name: str, split_experts: bool = True) -> int | None:
    """shard_dim in the tensor-parallel rollout: a packed expert tensor [E, ...] is split by
    whole experts (dim 0) when the rollout splits its experts (engine/tensor_parallel.py),
    else held whole; the router (mlp.gate.weight) is whole on every rank; the per-head
    tensors of sink attention and MLA (HEAD_ROWS) are split by heads."""
    if name.endswith(PACKED_EXPERTS):
        return 0 if split_experts else None
    if name.endswith(HEAD_ROWS):
        return 0
    return shard_dim(name)


def deltanet_sections(config) -> tuple[int, int, int] | None:
    """The widths of the [q; k; v] sections of a Gated DeltaNet layer's in_proj_qkv and conv
    rows (SECTIONED_ROWS) of a ModelArchitecture; None: the model has no such layer."""
    if not config.linear_num_key_heads:
        return None
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    return keys, keys, config.linear_num_value_heads * config.linear_value_head_dim


def rollout_pieces(name: str, shape: tuple[int, ...], index: int, size: int,
                   split_experts: bool = True,
                   sections: tuple[int, ...] | None = None) -> tuple[Block, ...]:  # fmt: skip
    """Rank ``index`` of ``size``'s blocks of parameter ``name`` in the tensor-parallel
    rollout, in the order its own tensor holds them along dim 0 (their concatenation): one
    block (rollout_shard_dim's split), or for a tensor of SECTIONED_ROWS its part of each of
    ``sections`` (deltanet_sections: rank r's key heads' q rows, then their k rows, then their
    value heads' v rows, as deltanet_parallel.head_channels lists them)."""
    if size == 1 or not name.endswith(SECTIONED_ROWS):
        return (tensor_parallel_block(shape, rollout_shard_dim(name, split_experts), index,
                                      size),)  # fmt: skip
    if sections is None or sum(sections) != shape[0]:
        raise ValueError(f"{name} {shape}: its rows are [q; k; v] sections, given {sections}")
    pieces, first = [], 0
    for width in sections:
        start, stop = even_range(width, index, size)
        pieces.append(((first + start, first + stop), *whole(shape)[1:]))
        first += width
    return tuple(pieces)


def as_pieces(blocks: Block | tuple[Block, ...]) -> tuple[Block, ...]:
    """A rank's block of a tensor, or its pieces (rollout_pieces), as pieces."""
    return (blocks,) if isinstance(blocks[0][0], int) else blocks


def whole(shape: tuple[int, ...]) -> Block:
    return tuple((0, size) for size in shape)


def numel(block: Block | None) -> int:
    if block is None:
        return 0
    count = 1
    for start, stop in block:
        count *= max(stop - start, 0)
    return count


def intersect(a: Block | None, b: Block | None) -> Block | None:
    """The common rectangle of a and b (None: they do not overlap)."""
    if a is None or b is None:
        return None
    common = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return common if all(start < stop for start, stop in common) else None


def even_range(length: int, index: int, parts: int) -> tuple[int, int]:
    """Part ``index`` of ``length`` cut in ``parts`` equal pieces (parts divides length)."""
    if length % parts:
        raise ValueError(f"{length} does not split into {parts} equal parts")
    step = length // parts
    return index * step, (index + 1) * step


def chunk_range(length: int, index: int, parts: int) -> tuple[int, int]:
    """Chunk ``index`` of torch.chunk(length, parts) as FSDP2 shards dim 0: chunks of
    ceil(length / parts), the last ones shorter or empty (start == stop)."""
    size = -(-length // parts)
    start = min(index * size, length)
    return start, min(start + size, length)


def with_range(block: Block, dim: int, span: tuple[int, int]) -> Block:
    """``block`` with dimension ``dim`` narrowed to ``span``, relative to its start."""
    start = block[dim][0]
    ranges = list(block)
    ranges[dim] = (start + span[0], start + span[1])
    return tuple(ranges)


def tensor_parallel_block(shape: tuple[int, ...], dim: int | None, index: int,
                          size: int) -> Block:  # fmt: skip
    """Shard ``index`` of ``size`` along ``dim`` (None: the whole tensor)."""
    block = whole(shape)
    if dim is None or size == 1:
        return block
    return with_range(block, dim, even_range(shape[dim], index, size))


def fsdp_block(block: Block, index: int, parts: int) -> Block | None:
    """FSDP2's shard ``index`` of ``parts`` of a (tensor-parallel) block: a dim-0 chunk;
    None when the chunk is empty."""
    rows = block[0][1] - block[0][0]
    span = chunk_range(rows, index, parts)
    return with_range(block, 0, span) if span[0] < span[1] else None


@dataclass(frozen=True)
class Transfer:
    source: int
    dest: int
    block: Block


def transfer_plan(sources: list[Block | None], dests: list[Block | None]) -> list[Transfer]:
    """Every (source rank, destination rank, block) that assembles each destination's block,
    destinations in rank order. ``sources[r]``: the block rank r holds (None: nothing);
    ranks holding the same block are replicas: a destination that is one of them copies its
    own, else it reads holder number dest % holders (replicas share the sending). Raises if
    the sources do not cover a destination's block."""
    holders: dict[Block, list[int]] = {}
    for rank, block in enumerate(sources):
        if block is not None:
            holders.setdefault(block, []).append(rank)
    plan = []
    for dest, wanted in enumerate(dests):
        covered = 0
        for block, ranks in holders.items():
            common = intersect(block, wanted)
            if common is None:
                continue
            source = dest if dest in ranks else ranks[dest % len(ranks)]
            plan.append(Transfer(source, dest, common))
            covered += numel(common)
        if covered != numel(wanted):
            raise ValueError(f"rank {dest}'s block {wanted} is covered by {covered} of its "
                             f"{numel(wanted)} elements: the source blocks overlap or leave gaps")  # fmt: skip
    return plan
