"""Forward passes over a batch in micro-batches, results scattered back to [B, R]."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.data.image_batch import MROPE_POSITIONS, PIXEL_VALUES, pack_images
from hybridflow.learners.core import TrainCore
from hybridflow.learners.packing import PackedRows, pack_rows, to_device
from hybridflow.protocol import Batch

REQUIRED_INPUTS = ("prompts", "responses", "attention_mask")


def check_keys(batch: Batch, keys: tuple[str, ...], caller: str) -> None:
    missing = [key for key in keys if key not in batch.tensors]
    if missing:
        raise KeyError(
            f"{caller} needs batch tensors {list(keys)}; missing {missing} "
            f"(present: {sorted(batch.tensors)})"
        )


def pack_batch_rows(batch: Batch, rows: list[int], device: torch.device) -> PackedRows:
    """Pack ``rows`` of the batch's prompts/responses (unpadded) and move them to ``device``,
    with the rollout's ``routed_experts`` when the batch has them (routing replay).

    Packing runs where the batch lives (the CPU, as the controller sends it): on a GPU its
    boolean indexing and ``max`` would each stall the host until the GPU is idle."""
    index = torch.as_tensor(rows, dtype=torch.long)
    prompts, responses, attention_mask, routed_experts, mrope_positions = (
        batch.tensors[key].index_select(0, index.to(batch.tensors[key].device))
        if key in batch.tensors
        else None
        for key in (*REQUIRED_INPUTS, "routed_experts", MROPE_POSITIONS)
    )
    packed = pack_rows(prompts, responses, attention_mask, routed_experts, mrope_positions)
    if PIXEL_VALUES in batch.arrays:
        packed.pixel_values, packed.image_grid_thw = pack_images(batch, rows)
    return packed.to(device)


@torch.no_grad()
def forward_response_tokens(
    core: TrainCore,
    batch: Batch,
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    run: Callable[[PackedRows], tuple[torch.Tensor, ...]],
) -> list[torch.Tensor]:
    """Call ``run(packed)`` on each micro-batch (eval mode, no grad); each returned [M] tensor
    is scattered back to ``[B, R]`` fp32 on the CPU, in the batch's row order.

    ``no_grad``, not ``inference_mode``: nothing is recorded for a backward either way, but a
    tensor made under inference_mode can never enter autograd later (the old and reference
    log-probs are inputs of the update's loss), nor be updated in place outside it (FSDP2
    allocates its unsharded parameter buffers in the first forward that needs them)."""
    check_keys(batch, REQUIRED_INPUTS, "forward")
    num_rows, response_length = batch.tensors["responses"].shape
    plan = core.plan_micro_batches(batch.tensors["attention_mask"], micro_batch_size, max_tokens)
    outputs: list[torch.Tensor] | None = None  # on the device; one copy back at the end
    was_training = core.module.training
    core.module.eval()
    try:
        with core.on_device():
            for rows in plan:
                # An empty micro-batch (fewer rows here than on another rank) still runs one
                # row so that every rank joins the same FSDP collectives; its output is dropped.
                packed = pack_batch_rows(batch, rows or [0], core.device)
                with core.autocast():
                    results = run(packed)
                if outputs is None:
                    outputs = [
                        torch.zeros(num_rows, response_length, device=core.device) for _ in results
                    ]
                if not rows:
                    continue
                row_index = to_device(torch.as_tensor(rows, dtype=torch.long), core.device)
                for out, values in zip(outputs, results):
                    out[row_index] = packed.scatter(values.float())
    finally:
        core.module.train(was_training)
        if core.fsdp:
            # FSDP2 keeps the root unit gathered after a forward that has no backward; free it.
            core.module.reshard()
    return [out.cpu() for out in outputs or []]
