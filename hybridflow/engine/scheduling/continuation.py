"""Admitting requests that continue a kept slot (kept.py): only the tokens past the slot's
cached prefix go through the model, in one extend pass (prefill.py) into the same slot; their
first tokens are then sampled like any admission's (admission.append_admitted). Functions over
the scheduler's state (state.py).

A prompt with images (images.py) continues its slot when its new tokens are text (the model's
turn and a tool's result): they turn at their cache position plus the slot's mRoPE shift, as
its decode steps did. New image tokens need the vision encoder, which the extend pass does not
run: such a prompt is prefilled in full instead (Scheduler.add)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridflow.engine.host import ranges, upload
from hybridflow.engine.images import set_slot_shifts
from hybridflow.engine.prefill import host_spans
from hybridflow.engine.scheduling import admission, preemption

if TYPE_CHECKING:
    from hybridflow.engine.scheduling.state import SchedulerState


def admit(scheduler: SchedulerState) -> None:
    """Admit requests that continue a kept slot: only the tokens past the cached prefix
    are prefilled (Engine.extend), into the same slot."""
    engine = scheduler.engine
    taken, tokens = [], 0
    while scheduler.extending:
        sub, request, slot, cached = scheduler.extending[0]
        sub.table.check()  # every id in range before it indexes the embedding
        new = len(sub.prompts[request]) - cached
        if taken and (tokens + new > engine.max_prefill_tokens
                      or not preemption.extension_fits(scheduler)):  # fmt: skip
            break
        taken.append(scheduler.extending.popleft())
        tokens += new
        if scheduler.paging is not None:
            scheduler.paging.grow([slot], [len(sub.prompts[request])])
    engine.prefill_tokens += tokens
    requests = [(sub, request) for sub, request, _, _ in taken]
    slots = [slot for _, _, slot, _ in taken]
    lengths = [len(sub.prompts[r]) for sub, r in requests]
    starts = torch.tensor([cached for _, _, _, cached in taken])
    counts = torch.tensor(lengths) - starts
    ids = torch.tensor([t for (s, r, _, c) in taken for t in s.prompts[r][c:]])
    positions = ranges(counts) + torch.repeat_interleave(starts, counts)
    max_new = [sub.max_new[r] for sub, r in requests]
    triton = engine.decode_backend == "triton"  # its varlen spans, built here: no sync
    span_tensors, span_maxima = host_spans(torch.tensor(slots), starts, counts) if triton else ((), ())  # fmt: skip
    token_slots = torch.repeat_interleave(torch.tensor(slots), counts)
    extra = {}
    if engine.vision:  # each slot's shift again (images.py): its decode goes on from it
        shifts = [_shift(sub, r) for sub, r in requests]
        set_slot_shifts(engine.rope, slots, shifts, engine.device)  # the extend turns by it
    if scheduler.paging is not None:
        if triton:  # the flash path gathers K/V by (block, offset)
            span_tensors = (*scheduler.paging.locate(*span_tensors[:2]), *span_tensors[2:])
        extra["cache_at"] = tuple(
            upload(engine.device, *scheduler.paging.locate(token_slots, positions))
        )
        scheduler.paging.sync_table()  # the decode-kernel path reads it
    (ids, positions, token_slots, last, seed_lo, seed_hi, row_positions, row_slots,
     max_new_dev, *span_dev) = upload(
        engine.device, ids, positions, token_slots, counts.cumsum(0) - 1,
        torch.tensor([sub.seed_lo[r] for sub, r in requests]),
        torch.tensor([sub.seed_hi[r] for sub, r in requests]), torch.tensor(lengths),
        torch.tensor(slots), torch.tensor(max_new), *span_tensors,
    )  # fmt: skip
    spans = {}
    if triton:
        gather_slots, gather_positions, cu_new, cu_all = span_dev
        spans = {"spans": (gather_slots, gather_positions, cu_new.to(torch.int32),
                           cu_all.to(torch.int32), *span_maxima)}  # fmt: skip
    # max_len from the host: without it the pass reads position_ids.max() back, a sync
    # behind the decode steps queued on the GPU at every agent turn
    logits = engine.extend(engine.model, scheduler.cache, engine.rope, ids, positions,
                           token_slots, last, max_len=max(lengths), **spans, **extra)  # fmt: skip  # [R, V]
    admission.append_admitted(scheduler, requests, slots, logits, seed_lo, seed_hi, row_positions,
                              row_slots, max_new_dev, max_new, lengths)  # fmt: skip


def _shift(sub, request: int) -> int:
    """The mRoPE shift of a continued request's prompt (0 without images; n is 1)."""
    entry = None if sub.images is None else sub.images.prepared[request]
    return 0 if entry is None else entry.shift


def extends_text_only(sub, request: int, cached: int, image_token_id: int | None) -> bool:
    """Whether the tokens a continuation would add past its slot's `cached` ones hold none
    of its images' tokens (those need the vision encoder: the prompt is prefilled in full)."""
    entry = None if sub.images is None else sub.images.prepared[request]
    if entry is None or image_token_id is None:
        return True
    return image_token_id not in sub.prompts[request][cached : entry.span]
