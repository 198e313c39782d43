"""The packed forward of a learner under Ulysses sequence parallelism.

Each rank of the sequence-parallel group runs the decoder on its contiguous slice of the
micro-batch's packed stream (models/sharding/sequence_parallel.py) and computes the per-token outputs
(log-probs, entropy, values) whose predicting token lies in its slice. Those few floats per
token are then gathered, so every rank of the group holds the whole micro-batch's outputs and
computes the same loss with the loss code of one process (token-mean over the global token
count and every other aggregation unchanged); the gather's backward gives each rank the
gradient of its own outputs, and FSDP's gradient reduction over the group sums the ranks'
parts (learners/step.py). A mixture of experts' routing is gathered the same way, so the
router losses see every token.

A vision-language model's images: every rank of the group runs the vision encoder on the
micro-batch's whole images (an image's tokens may straddle two slices, and the encoder's
attention spans an image), then takes the features of the image tokens in its slice, in
order, into its slice's embeddings (sliced_embeddings), and its slice of mRoPE's three
position rows. The encoder's gradient on each rank is that of its slice's features, summed
over the group with every other parameter's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.learners.packing import PackedRows
from hybridflow.models.moe import NO_ROUTE
from hybridflow.models.sharding.sequence_parallel import (
    gather_outputs,
    output_range,
    pad_positions,
    shard_stream,
    take_slice,
)


@dataclass(frozen=True)
class OutputShard:
    """Which of a micro-batch's M outputs this rank computes: ``[start, stop)``."""

    start: int
    stop: int
    counts: list[int]
    """Outputs of every rank of the group, in rank order."""
    group: dist.ProcessGroup

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's ``[stop - start]`` values -> all ``[M]`` (differentiable)."""
        return gather_outputs(values, self.counts, self.group)


def sharded_hidden(
    lm: nn.Module,
    packed: PackedRows,
    group: dist.ProcessGroup,
    *,
    routed_experts: torch.Tensor | None = None,
    router_trace: list | None = None,
    token_multiple: int = 1,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    image_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, OutputShard]:
    """Hidden states [m, H] of the tokens that predict this rank's outputs, and which outputs
    they are. ``router_trace`` receives each sparse layer's routing of the whole stream.
    token_multiple: each rank's slice padded to a multiple of it (FP8 training's 16); the pad
    is a sequence of its own that no output reads (sequence_parallel.shard_stream).
    pixel_values, image_grid_thw, image_slots: the micro-batch's images (module docstring)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    shards = [
        shard_stream(packed.cu_seqlens, packed.max_seqlen, r, size, token_multiple)
        for r in range(size)
    ]
    shard = shards[rank]
    local_trace = [] if router_trace is not None else None
    embeds = None
    if pixel_values is not None:
        embeds = sliced_embeddings(lm, packed.input_ids, shard, pixel_values, image_grid_thw,
                                   image_slots)  # fmt: skip
    hidden = lm.forward_packed(
        take_slice(packed.input_ids, shard),
        pad_positions(packed.position_ids, shard),
        shard.cu_seqlens,
        shard.max_seqlen,
        routed_experts=None
        if routed_experts is None
        else take_slice(routed_experts, shard, fill=NO_ROUTE),
        router_trace=local_trace,
        sequence_group=group,
        input_embeds=embeds,
    )  # [N / SP, H]
    if router_trace is not None:
        num_tokens = packed.input_ids.shape[0]
        real = [max(min(s.stop, num_tokens) - s.start, 0) for s in shards]  # pad excluded
        for logits, ids in local_trace:
            router_trace.append(
                (gather_outputs(logits[: real[rank]], real, group),
                 gather_outputs(ids[: real[rank]], real, group))
            )  # fmt: skip
    spans = [output_range(packed.hidden_index, s) for s in shards]
    start, stop = spans[rank]
    outputs = OutputShard(start, stop, [b - a for a, b in spans], group)
    return hidden[packed.hidden_index[start:stop] - shard.start], outputs


def sliced_embeddings(lm: nn.Module, input_ids: torch.Tensor, shard, pixel_values: torch.Tensor,
                      image_grid_thw: torch.Tensor, image_slots: torch.Tensor | None = None,
                      ) -> torch.Tensor:  # fmt: skip
    """The embeddings [stop - start, H] of this rank's slice of the stream ``input_ids`` [N],
    the vision encoder's features at its image tokens: the encoder runs on all the images
    (CausalLM.image_features), and the slice takes the features of the image tokens it holds,
    those after the image tokens of the slices before it."""
    slots, features = lm.image_features(input_ids, pixel_values, image_grid_thw, image_slots)
    hidden = lm.model.embed_tokens(take_slice(input_ids, shard))
    before = int(slots[: shard.start].sum())
    mine = take_slice(slots, shard, fill=False)
    own = features[before : before + int(mine.sum())].to(hidden.dtype)
    return hidden.masked_scatter(mine.unsqueeze(-1), own)
