"""When a paged KV cache runs short (paging.py): the scheduler's rows make room and the
requests preempted for it come back.

Functions over the scheduler's rows and queues (state.py), called at admission and
before each chunk of decode steps: evicting kept KV first, then preempting the newest
requests (every row's tokens read back first, so a preempted request keeps all it sampled),
and prefilling a preempted request again once its blocks are free. vLLM calls this recompute
preemption; the alternative, swapping blocks out to host memory, needs no recompute but a
host copy of the K/V, and a recompute of a prompt's worth of tokens is cheap next to the
decode steps it took to generate them.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from hybridflow.engine.host import upload
from hybridflow.engine.images import Segment, has_images, prefill_inputs, set_slot_shifts
from hybridflow.engine.scheduling import readback

if TYPE_CHECKING:
    from hybridflow.engine.requests import LiveRequest
    from hybridflow.engine.scheduling.state import SchedulerState


def evict_kept_for(scheduler: SchedulerState, blocks: int) -> int:
    """Evict kept KV, oldest first, until `blocks` are free or none is kept; -> free."""
    while scheduler.paging.free_blocks < blocks and len(scheduler.engine.kept):
        scheduler.free_slot(scheduler.engine.kept.evict_oldest())
    return scheduler.paging.free_blocks


def growth_reserve(scheduler: SchedulerState) -> int:
    """Blocks held back for the live rows to grow into (the admission watermark): one for each
    row whose blocks do not yet reach its last position. A row that cannot outgrow its blocks
    reserves none: with a max_seq_len of one block, a reserve per row would admit only half
    of max_batch_size at the cap of every sequence at full length (sizing.plan_blocks), and
    evict kept KV the slot cache keeps."""
    pool, limit = scheduler.paging.pool, scheduler.cache.max_seq_len
    return sum(pool.missing(live.slot, min(end, limit)) > 0
               for live, end in zip(scheduler.rows, scheduler.row_end))  # fmt: skip


def blocks_for_next(scheduler: SchedulerState) -> bool:
    """Whether blocks are free past the live rows' growth reserve."""
    reserve = growth_reserve(scheduler)
    return evict_kept_for(scheduler, reserve + 2) > reserve + 1 or not scheduler.rows


def extension_fits(scheduler: SchedulerState) -> bool:
    """Whether the first continuation's new tokens have blocks (kept KV evicted for them;
    with nothing decoding, one that still does not fit is prefilled in full instead)."""
    if scheduler.paging is None:
        return True
    sub, request, slot, _ = scheduler.extending[0]
    need = scheduler.paging.pool.missing(slot, len(sub.prompts[request]))
    need += growth_reserve(scheduler)
    if evict_kept_for(scheduler, need) >= need:
        return True
    if not scheduler.rows:
        scheduler.extending.popleft()
        scheduler.free_slot(slot)
        scheduler.waiting.appendleft((sub, request))
    return False


def make_room(scheduler: SchedulerState, steps: int) -> int:
    """Blocks for every position the next `steps` decode steps write, in the device
    table. Short of them: kept KV goes first, then (after reading every row's tokens
    back) the newest requests are preempted until the rest fit. -> the steps to run (0:
    no row is left)."""
    paging, limit = scheduler.paging, scheduler.cache.max_seq_len

    def needs():
        slots = [live.slot for live in scheduler.rows]
        ends = [min(end - budget + steps, limit)
                for end, budget in zip(scheduler.row_end, scheduler.row_budget)]  # fmt: skip
        return slots, ends, paging.missing(slots, ends)

    slots, ends, missing = needs()
    if missing > evict_kept_for(scheduler, missing):
        readback.flush(scheduler)  # exact tokens for the preempted; rows that finished retire
        slots, ends, missing = needs()
        while scheduler.rows and missing > paging.free_blocks:
            newest = max(scheduler.rows, key=lambda live: live.key)
            scheduler.retire({newest}, preempt=True)
            paging.preemptions += 1
            slots, ends, missing = needs()
        scheduler.resuming = deque(sorted(scheduler.resuming, key=lambda live: live.key))
        steps = min(steps, max(scheduler.row_budget, default=0))
    paging.grow(slots, ends)
    paging.sync_table()
    return steps if scheduler.rows else 0


def can_resume(scheduler: SchedulerState) -> bool:
    """Whether the oldest preempted request can be prefilled again now."""
    live = scheduler.resuming[0]
    length = len(live.sub.prompt_of(live.request)) + len(live.tokens)
    need = scheduler.paging.pool.blocks_for(length) + growth_reserve(scheduler)
    # (with nothing decoding, only continuations waiting for their kept slots can hold
    # blocks: they go first, or give theirs back: extension_fits)
    return bool(scheduler.free_slots) and evict_kept_for(scheduler, need) >= need


def resume(scheduler: SchedulerState) -> None:
    """Prefill the oldest preempted request's prompt and tokens but the last (which has
    not been through the model) into a free slot; it decodes on from its last token, its
    sampling step where it stopped, so it draws what it would have drawn unpreempted."""
    live, sequence = take_resumed(scheduler)
    engine, slot, length = scheduler.engine, live.slot, len(sequence)
    positions = torch.arange(length)
    slots = torch.full((length,), slot)
    ids, positions_dev, slots_dev, entries, offsets, cu = upload(
        engine.device, torch.tensor(sequence), positions, slots,
        *scheduler.paging.locate(slots, positions), torch.tensor([0, length]),
    )  # fmt: skip
    extra = {}
    if engine.vision:  # its images' features again (images.py), its slot's decode shift
        prompt = live.request // live.sub.n
        segment = Segment(live.sub.images, prompt, len(live.sub.prompts[prompt]), length)
        set_slot_shifts(engine.rope, [slot], [segment.shift], engine.device)
        if has_images([segment]):
            features = live.sub.images.features
            held = prompt in features  # its other samples still to be admitted
            extra["inputs"] = prefill_inputs(engine.model, ids, [segment])
            if not held:
                features.pop(prompt)
    engine.prefill(engine.model, scheduler.cache, engine.rope, ids, positions_dev, slots_dev,
                   cu.to(torch.int32), length, cu[1:] - 1, cache_at=(entries, offsets),
                   **extra)  # fmt: skip
    append_resumed(scheduler, live, length)


def take_resumed(scheduler: SchedulerState) -> tuple[LiveRequest, list[int]]:
    """The oldest preempted request into a free slot with blocks for what it recomputes:
    -> (it, the token ids whose K/V the slot must hold again)."""
    live = scheduler.resuming.popleft()
    sub = live.sub
    slot = live.slot = scheduler.free_slots.pop()
    sequence = [*sub.prompt_of(live.request), *live.tokens[:-1]]
    scheduler.engine.prefill_tokens += len(sequence)  # recomputed: the price of preemption
    scheduler.paging.grow([slot], [len(sequence)])
    return live, sequence


def append_resumed(scheduler: SchedulerState, live: LiveRequest, length: int) -> None:
    """A resumed request whose slot holds `length` positions again back as a live row, at
    its last token and sampling step."""
    sub, engine, slot = live.sub, scheduler.engine, live.slot
    scheduler.count_live(sub)
    if scheduler.subs_changed:
        scheduler.sync_submissions()
    first = scheduler.state.num_rows
    scheduler.state.set_row_sampling(first, [sub.mode])
    max_new, generated = sub.max_new[live.request], len(live.tokens)
    token, position, slot_dev, max_new_dev, seed_lo, seed_hi, generated_dev = upload(
        engine.device, *(torch.tensor([value]) for value in (
            live.tokens[-1], length, slot, max_new, sub.seed_lo[live.request],
            sub.seed_hi[live.request], generated)),
    )  # fmt: skip
    logprob = torch.tensor([live.logprobs[-1]], device=engine.device)
    scheduler.state.append_rows(token, logprob, position, slot_dev, max_new_dev, seed_lo, seed_hi,
                           generated=generated_dev)  # fmt: skip
    scheduler.rows.append(live)
    scheduler.row_budget.append(max_new - generated)
    scheduler.row_end.append(length + 1 + max_new - generated)
    scheduler.row_admission.append(-1 - live.key)  # a group of its own (shared_prefix.py)
    scheduler.groups_changed = True
