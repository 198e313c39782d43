"""Admitting waiting requests into free slots: one packed prefill pass per admission (one
prefill per unique prompt, its K/V fanned out to the slots of its n samples), then the first
tokens sampled and the requests appended as live rows. Functions over the scheduler's state
(state.py), like continuation.py (kept slots) and preemption.py (a paged cache's room)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridflow.engine.host import ranges, upload
from hybridflow.engine.images import Segment, has_images, prefill_inputs, set_slot_shifts
from hybridflow.engine.requests import LiveRequest, Submission
from hybridflow.engine.row_sampling import mixed_mode
from hybridflow.engine.scheduling import preemption

if TYPE_CHECKING:
    from hybridflow.engine.scheduling.state import SchedulerState


def take_waiting(scheduler: SchedulerState) -> list[tuple[Submission, int]]:
    """Requests for one prefill pass, in queue order: up to the free slots and the
    prefill token budget (a prompt's samples count its tokens once)."""
    taken: list[tuple[Submission, int]] = []
    tokens, budget = 0, scheduler.engine.max_prefill_tokens
    paging = scheduler.paging
    blocks = paging.free_blocks - preemption.growth_reserve(scheduler) if paging is not None else 0
    while scheduler.waiting and len(taken) < len(scheduler.free_slots):
        sub, request = scheduler.waiting[0]
        prompt = request // sub.n
        new_prompt = not taken or taken[-1][0] is not sub or taken[-1][1] // sub.n != prompt
        length = int(sub.table.lengths[prompt])
        if new_prompt and taken and tokens + length > budget:
            break
        if paging is not None:  # its prompt, and a block to grow into if it can grow
            need = paging.prompt_blocks(length, new_prompt)
            end = min(length + sub.max_new[request], scheduler.cache.max_seq_len)
            grows = int(paging.pool.blocks_for(end) > paging.pool.blocks_for(length))
            if not taken and not scheduler.rows:  # nothing decodes: no growth block needed
                blocks = preemption.evict_kept_for(scheduler, need + grows)
            else:
                need += grows
            blocks -= need
            if blocks < 0:
                break
        tokens += length if new_prompt else 0
        taken.append(scheduler.waiting.popleft())
    scheduler.engine.prefill_tokens += tokens
    return taken


def admit(scheduler: SchedulerState) -> bool:
    """One prefill pass of waiting requests; False when none could be taken (a paged
    cache without the blocks for the first)."""
    taken = take_waiting(scheduler)
    if not taken:
        return False
    slots = [scheduler.free_slots.pop() for _ in taken]
    # One prefill per unique prompt (its first request's slot), then KV fan-out.
    firsts: list[int] = []  # index into `taken` of each unique prompt's first request
    group: list[int] = []  # unique-prompt index of each taken request
    runs: list[list] = []  # [submission, first prompt, last prompt + 1]: contiguous ids
    for i, (sub, request) in enumerate(taken):
        prompt = request // sub.n
        if not firsts or taken[firsts[-1]][0] is not sub or taken[firsts[-1]][1] // sub.n != prompt:  # fmt: skip
            firsts.append(i)
            if runs and runs[-1][0] is sub and runs[-1][2] == prompt:
                runs[-1][2] += 1
            else:
                runs.append([sub, prompt, prompt + 1])
        group.append(len(firsts) - 1)
    lengths = torch.from_numpy(np.concatenate([s.table.lengths[a:b] for s, a, b in runs]))
    prompt_ids = torch.cat([s.table.tokens(a, b) for s, a, b in runs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    group_t = torch.tensor(group)
    first_slots = torch.tensor([slots[i] for i in firsts])
    # Prefix fan-out (n > 1): positions [0, len) of each prompt's first slot to the
    # slots of its other samples, as flat (src slot, dst slot, position) index lists.
    first_set = set(firsts)
    copies = torch.tensor([i for i in range(len(taken)) if i not in first_set], dtype=torch.long)
    copy_lengths = lengths[group_t[copies]]
    copy_src = torch.repeat_interleave(first_slots[group_t[copies]], copy_lengths)
    copy_dst = torch.repeat_interleave(torch.tensor(slots)[copies], copy_lengths)
    copy_pos = ranges(copy_lengths)
    paged_copies = cache_at = None
    if scheduler.paging is not None:
        paged_copies = scheduler.paging.place(slots, firsts, group, lengths.tolist())
        cache_at = scheduler.paging.locate(torch.repeat_interleave(first_slots, lengths),
                                           ranges(lengths))  # fmt: skip
        copy_src = copy_dst = copy_pos = torch.zeros(0, dtype=torch.int64)
    max_new = [sub.max_new[r] for sub, r in taken]
    engine = scheduler.engine
    (
        ids, positions, token_slots, cu_dev, group_dev, seed_lo, seed_hi, row_positions,
        row_slots, max_new_dev, copy_src, copy_dst, copy_pos,
    ) = upload(
        engine.device, prompt_ids, ranges(lengths),
        torch.repeat_interleave(first_slots, lengths), cu, group_t,
        torch.tensor([sub.seed_lo[r] for sub, r in taken]),
        torch.tensor([sub.seed_hi[r] for sub, r in taken]), lengths[group_t],
        torch.tensor(slots), torch.tensor(max_new), copy_src, copy_dst, copy_pos,
    )  # fmt: skip
    extra = {}
    if cache_at is not None:
        extra["cache_at"] = tuple(upload(engine.device, *cache_at))
    if engine.vision:
        extra.update(_image_inputs(engine, taken, slots, group, runs, ids))
    logits = engine.prefill(
        engine.model, scheduler.cache, engine.rope, ids, positions, token_slots,
        cu_dev.to(torch.int32), int(lengths.max()), cu_dev[1:] - 1, **extra,
    )  # fmt: skip  # [U, V]
    if copy_pos.numel():
        scheduler.cache.copy_entries((copy_src, copy_pos), (copy_dst, copy_pos))
    if len(copies) and scheduler.cache.per_sequence:  # per-sequence kinds, once a sample
        sequence_src, sequence_dst = upload(engine.device, first_slots[group_t[copies]],
                                            torch.tensor(slots)[copies])  # fmt: skip
        scheduler.cache.copy_sequences(sequence_src, sequence_dst)
    if paged_copies is not None:
        src, src_at, dst, dst_at = upload(engine.device, *paged_copies)
        scheduler.cache.copy_entries((src, src_at), (dst, dst_at))
    prompt_lengths = lengths.tolist()
    append_admitted(scheduler, taken, slots, logits[group_dev], seed_lo, seed_hi,
                    row_positions, row_slots, max_new_dev, max_new,
                    [prompt_lengths[g] for g in group])  # fmt: skip
    for sub in {sub for sub, _ in taken}:
        sub.table.check()  # the rest of its ids, while the GPU runs this prefill (once)
    return True


def _image_inputs(engine, taken, slots, group, runs, ids) -> dict:
    """A vision-language engine's admission: each slot's decode shift set, and the prefill's
    inputs (images.prefill_inputs) when a prompt has images; each prompt's encoder features
    dropped once its last sample is admitted."""
    segments = [Segment(sub.images, prompt, length, length)
                for sub, first, last in runs for prompt in range(first, last)
                for length in [int(sub.table.lengths[prompt])]]  # fmt: skip
    set_slot_shifts(engine.rope, slots, [segments[g].shift for g in group], engine.device)
    inputs = {}
    if has_images(segments):
        inputs["inputs"] = prefill_inputs(engine.model, ids, segments)
    for sub, request in taken:
        if sub.images is not None:
            sub.images.admitted(request)
    return inputs


def append_admitted(scheduler: SchedulerState, taken, slots, logits, seed_lo, seed_hi,
                    row_positions, row_slots, max_new_dev, max_new,
                    prompt_lengths) -> None:  # fmt: skip
    """Sample the admitted requests' first tokens and append them as live rows."""
    for sub, _ in taken:
        scheduler.count_live(sub)
    if scheduler.subs_changed:
        scheduler.sync_submissions()  # the stop ids the first tokens are checked against
    first = scheduler.state.num_rows
    modes = [sub.mode for sub, _ in taken]
    scheduler.state.set_row_sampling(first, modes)
    params = taken[0][0].params
    if any(mode != modes[0] for mode in modes):
        params = mixed_mode(set(modes))
    rows = slice(first, first + len(taken))
    first_tokens, first_logprobs = scheduler.runner.sample(
        logits, seed_lo, seed_hi, torch.zeros_like(seed_lo), params=params, rows=rows
    )
    scheduler.state.append_rows(first_tokens, first_logprobs, row_positions, row_slots,
                                max_new_dev, seed_lo, seed_hi)  # fmt: skip
    scheduler.rows += [LiveRequest(sub, r, slot, scheduler.version)
                       for (sub, r), slot in zip(taken, slots)]  # fmt: skip
    scheduler.row_budget += [m - 1 for m in max_new]
    scheduler.row_end += [length + m for length, m in zip(prompt_lengths, max_new)]
    scheduler.row_admission += [scheduler.admissions] * len(taken)
    scheduler.admissions += 1
    scheduler.groups_changed = True
