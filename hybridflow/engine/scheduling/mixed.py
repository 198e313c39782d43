"""Mixed steps (EngineOptions.max_prefill_tokens_per_step > 0): one forward per scheduler step
carries every live row's next token and chunks of the prompts being prefilled, the design of
vLLM's and SGLang's chunked prefill.

A request admitted here takes its slot (and a paged cache's blocks for its whole prompt) at
once and becomes a PrefillJob: its prompt's tokens go through the model a chunk per step, up
to the step's token budget, beside the decode rows (the first tokens of the forward, each
attending over its slot like a decode step, sampled and advanced as one). A job whose last
chunk ran fans its K/V out to its samples' slots and samples their first tokens from that
chunk's last logits: they are live rows from the next step on. A continuation of a kept slot
(kept.py) is a job that starts at the slot's cached length; a preempted request's recompute
(preemption.py) is a job whose row goes on from the last token it sampled.

A prompt with images is a job too: each of its chunks takes its slice of the prompt's
mRoPE rows and its share of the encoder's features (images.chunk_inputs), and a step
holding such a chunk runs eagerly, not as a static step.

So a decode row waits at most one step for a new request, however long its prompt, and a
turn of an agent's episode costs its own tokens in a step, not a pass of its own. A burst of
requests that arrives while nothing decodes is the exception: the steps after the first take
the rest of it without the rows it admitted (at the no-row budget, max_prefill_tokens), so
the burst decodes in step, as after separate prefill passes (a share admitted a budget per
step would end its turn that many steps after the rest: the batch's tail). Steps with
no job replay the decode graphs as before (scheduler.py). Functions over the scheduler's
state (state.py), like admission.py and continuation.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridflow.engine.host import ranges, upload
from hybridflow.engine.images import ImageChunk, Segment, chunk_inputs, set_slot_shifts
from hybridflow.engine.prefill import host_spans
from hybridflow.engine.requests import Completion, Submission
from hybridflow.engine.scheduling import admission, preemption
from hybridflow.engine.scheduling.view import PrefillJob

if TYPE_CHECKING:
    from hybridflow.engine.scheduling.state import SchedulerState


# -- admission ----------------------------------------------------------------------------------


def open_jobs(scheduler: SchedulerState) -> None:
    """Preempted requests, continuations of kept slots, then waiting requests, into jobs
    while slots (and a paged cache's blocks) last: no waiting for company, a job costs only
    its tokens in a step."""
    while scheduler.resuming and preemption.can_resume(scheduler):
        live, sequence = preemption.take_resumed(scheduler)
        job = PrefillJob([(live.sub, live.request)], [live.slot], sequence, 0, resumed=live)
        _start(scheduler, job)
    while scheduler.extending and preemption.extension_fits(scheduler):
        sub, request, slot, cached = scheduler.extending.popleft()
        sub.table.check()  # every id in range before it indexes the embedding
        prompt = sub.prompts[request]
        if scheduler.paging is not None:
            scheduler.paging.grow([slot], [len(prompt)])
        scheduler.engine.prefill_tokens += len(prompt) - cached
        _start(scheduler, PrefillJob([(sub, request)], [slot], prompt, cached))
    while scheduler.waiting and not scheduler.resuming and _has_room(scheduler):
        taken = admission.take_waiting(scheduler)
        if not taken:
            return
        for group in _prompt_groups(taken):
            _open_job(scheduler, group)


def _has_room(scheduler: SchedulerState) -> bool:
    if not scheduler.free_slots and len(scheduler.engine.kept):  # kept KV gives way
        scheduler.free_slot(scheduler.engine.kept.evict_oldest())
    if scheduler.paging is not None and not preemption.blocks_for_next(scheduler):
        return False
    return bool(scheduler.free_slots)


def _prompt_groups(taken: list[tuple[Submission, int]]) -> list[list[tuple[Submission, int]]]:
    """Consecutive requests of one prompt (its samples) together."""
    groups: list[list[tuple[Submission, int]]] = []
    for sub, request in taken:
        head = groups[-1][0] if groups else None
        if head is not None and head[0] is sub and head[1] // sub.n == request // sub.n:
            groups[-1].append((sub, request))
        else:
            groups.append([(sub, request)])
    return groups


def _open_job(scheduler: SchedulerState, group: list[tuple[Submission, int]]) -> None:
    sub, first = group[0]
    sub.table.check()  # every id in range before it indexes the embedding
    slots = [scheduler.free_slots.pop() for _ in group]
    prompt = sub.prompt_of(first)
    copies = None
    if scheduler.paging is not None:  # the first slot's blocks, shared by the other samples
        copies = scheduler.paging.place(slots, [0], [0] * len(group), [len(prompt)])
    _start(scheduler, PrefillJob(group, slots, prompt, 0, copies))


def _start(scheduler: SchedulerState, job: PrefillJob) -> None:
    """A job joins the prefilling ones; a vision-language engine sets its slots' decode
    shift first (images.py; 0 for a text prompt: the slot may have held one with images)."""
    engine = scheduler.engine
    if engine.vision:
        shift = _segment(job).shift
        set_slot_shifts(engine.rope, job.slots, [shift] * len(job.slots), engine.device)
    scheduler.prefilling.append(job)


def _segment(job: PrefillJob) -> Segment:
    """The job's sequence as an images.Segment (its prompt's images, or none)."""
    sub, request = job.requests[0]
    prompt = request // sub.n
    return Segment(sub.images, prompt, len(sub.prompt_of(request)), len(job.sequence))


def _has_images(job: PrefillJob) -> bool:
    sub, request = job.requests[0]
    return sub.images is not None and sub.images.prepared[request // sub.n] is not None


def _release_features(jobs: list[PrefillJob]) -> None:
    """Jobs ended (their last chunk ran, or aborted): their prompts' encoder features go
    once no sample of the prompt is still to be admitted (images.ImageFeatures)."""
    for job in jobs:
        sub, request = job.requests[0]
        if sub.images is None:
            continue
        if job.resumed is not None:
            sub.images.recomputed(request // sub.n)
            continue
        for _, request in job.requests:
            sub.images.admitted(request)


def abort(scheduler: SchedulerState, sub: Submission, request: int) -> bool:
    """A request of a job (already in sub.aborted): False when no job holds it. A job ends
    when all its requests are aborted (slots back, each finished with 'abort'); until then
    the others go on and the aborted one is retired as it goes live (finish_jobs)."""
    for job in scheduler.prefilling:
        if (sub, request) not in job.requests:
            continue
        if all(r in s.aborted for s, r in job.requests):
            scheduler.prefilling.remove(job)
            _release_features([job])
            for slot in job.slots:
                scheduler.free_slot(slot)
            live = job.resumed  # a preempted request keeps what it had sampled
            tokens, logprobs = (live.tokens, live.logprobs) if live else ([], [])
            spans = tuple(live.spans) if live else ((0, scheduler.version),)
            for s, r in job.requests:
                if s.results[r] is None:
                    s.finish(r, Completion(tokens, logprobs, "abort", version_spans=spans))
        return True
    return False


# -- one step -----------------------------------------------------------------------------------


def run_step(scheduler: SchedulerState) -> int:
    """One forward: the live rows' next tokens (when any may still decode) and the jobs'
    next chunks; rows advanced and finished jobs' requests appended as live rows. -> decode
    steps run (0 or 1). With rows to decode and a static step (static_step.py: graph_mixed_steps
    on the fused backend) the forward has static shapes and replays as a CUDA graph."""
    starts_burst = not scheduler.rows  # nothing decodes: a burst of requests starts here
    burst = min(scheduler.burst_tokens, sum(job.left for job in scheduler.prefilling))
    rows = 0
    if scheduler.rows and max(scheduler.row_budget) > 0 and not burst:
        if scheduler.subs_changed:
            scheduler.sync_submissions()
        room = scheduler.paging is None or preemption.make_room(scheduler, 1)
        rows = len(scheduler.rows) if room else 0
    static = scheduler.static_step if rows else None
    chunks = _chunks(scheduler, rows, static.max_chunks if static is not None else None)
    if any(_has_images(job) for job, _, _ in chunks):
        # a prompt with images turns by its mRoPE rows and reads the encoder's features,
        # which the static step's fixed buffers do not hold: its steps run eagerly
        static = None
    for job, _, count in chunks:
        job.done += count
        scheduler.chunk_tokens += count
    taken = sum(count for _, _, count in chunks)
    # The rest of a burst that came while nothing decoded is prefilled before its first rows
    # decode, as separate passes would: it joins them at once, not a budget a step later,
    # where it would finish its turn that many steps after them (the batch's tail).
    left = sum(job.left for job in scheduler.prefilling)
    scheduler.burst_tokens = left if starts_burst else max(burst - taken, 0)
    finished = [i for i, (job, _, _) in enumerate(chunks) if not job.left]
    if static is not None:
        job_logits = static.run(scheduler.paging, rows, chunks, finished)
    else:
        job_logits = _eager_forward(scheduler, rows, chunks, finished)
    if rows:
        scheduler.decode_steps += 1
        scheduler.mixed_steps += 1
        scheduler.decoded_rows += rows
        scheduler.row_budget[:rows] = [b - 1 for b in scheduler.row_budget[:rows]]
    if finished:
        finish_jobs(scheduler, [chunks[i][0] for i in finished], job_logits)
    return int(rows > 0)


def _eager_forward(scheduler: SchedulerState, rows: int, chunks, finished: list[int]):
    """The step's forward as the engine's extend pass (sized by the step's tokens), the rows
    sampled and advanced. -> the finished chunks' last logits [len(finished), V]."""
    engine, state = scheduler.engine, scheduler.state
    starts = torch.tensor([start for _, start, _ in chunks])
    counts = torch.tensor([count for _, _, count in chunks])
    chunk_slots = torch.tensor([job.slots[0] for job, _, _ in chunks])
    ids = torch.tensor([t for job, start, n in chunks for t in job.sequence[start : start + n]])
    positions = ranges(counts) + torch.repeat_interleave(starts, counts)
    token_slots = torch.repeat_interleave(chunk_slots, counts)
    ends = counts.cumsum(0) - 1 + rows  # each chunk's last token in the forward
    keep = torch.cat([torch.arange(rows), ends[finished]])
    triton = engine.decode_backend == "triton"
    spans = host_spans(chunk_slots, starts, counts) if triton else ((), ())
    span_tensors = spans[0]
    cache_at = ()
    if scheduler.paging is not None:
        if triton:  # the flash path gathers K/V by (block, offset)
            span_tensors = (*scheduler.paging.locate(*span_tensors[:2]), *span_tensors[2:])
        cache_at = scheduler.paging.locate(token_slots, positions)
        scheduler.paging.sync_table()  # decode rows' and decode_attention's block table
    ids, positions, token_slots, keep, *rest = upload(
        engine.device, ids, positions, token_slots, keep, *cache_at, *span_tensors
    )
    all_ids = torch.cat([state.tokens[:rows], ids])
    all_positions = torch.cat([state.positions[:rows], positions])
    all_slots = torch.cat([state.row_slots[:rows], token_slots])
    extra = _image_inputs(engine, chunks, rows, all_ids, all_positions, all_slots)
    if cache_at:
        chunk_at, rest = rest[:2], rest[2:]
        row_at = scheduler.cache.locate(state.row_slots[:rows], state.positions[:rows])
        extra["cache_at"] = tuple(torch.cat([a, b]) for a, b in zip(row_at, chunk_at))
    if rows and scheduler.cache.per_sequence:  # rows the device has finished
        extra["frozen"] = state.finished[:rows]
    if triton:
        gather_slots, gather_positions, cu_new, cu_all = rest
        extra["spans"] = (gather_slots, gather_positions, cu_new.to(torch.int32),
                          cu_all.to(torch.int32), *spans[1])  # fmt: skip
    max_len = max(int((starts + counts).max()), scheduler.max_live_len(1) if rows else 1)
    logits = engine.extend(
        engine.model, scheduler.cache, engine.rope, all_ids, all_positions, all_slots, keep,
        decode_rows=rows, max_len=min(max_len, scheduler.cache.max_seq_len), **extra,
    )  # fmt: skip  # [rows + finished jobs, V]
    if rows:
        scheduler.runner.advance_rows(logits[:rows], rows)
    return logits[rows:]


def _image_inputs(engine, chunks, rows: int, ids, positions, slots) -> dict:
    """The extend pass's inputs (images.chunk_inputs) when a chunk is of a prompt with
    images: the forward's embeddings and cos/sin, its image chunks' mRoPE rows and features
    in their places; {} otherwise."""
    image_chunks, at = [], rows
    for job, start, count in chunks:
        if _has_images(job):
            image_chunks.append(ImageChunk(_segment(job), job.sequence, start, count, at))
        at += count
    if not image_chunks:
        return {}
    rotary = engine.rope.rotary_positions(positions, slots)
    return {"inputs": chunk_inputs(engine.model, engine.rope, ids, rotary, image_chunks)}


def _chunks(scheduler: SchedulerState, rows: int,
            max_jobs: int | None = None) -> list[tuple[PrefillJob, int, int]]:  # fmt: skip
    """(job, first position, token count) of this step's chunks, oldest jobs first, up to the
    step's budget: max_prefill_tokens_per_step beside decode rows; with none, no row waits
    for the step, and it takes a whole prefill pass's tokens (max_prefill_tokens), as many
    as the separate passes would (a burst of prompts costs as few forwards). max_jobs: at
    most that many chunks (a static step's)."""
    options = scheduler.engine.options
    budget = options.max_prefill_tokens_per_step
    if not rows:
        budget = max(budget, options.max_prefill_tokens)
    chunks = []
    for job in scheduler.prefilling:
        if budget <= 0 or len(chunks) == max_jobs:
            break
        count = min(job.left, budget)
        chunks.append((job, job.done, count))
        budget -= count
    return chunks


def finish_jobs(scheduler: SchedulerState, jobs: list[PrefillJob], logits: torch.Tensor) -> None:
    """Jobs whose last chunk ran (logits [len(jobs), V]: their last tokens'): K/V fanned out
    to the other samples' slots, first tokens sampled, requests appended as live rows."""
    engine = scheduler.engine
    for job in jobs:
        scheduler.prefilling.remove(job)
    _release_features(jobs)
    for job in jobs:
        if job.resumed is not None:  # its next token is the last it sampled: no sampling
            preemption.append_resumed(scheduler, job.resumed, len(job.sequence))
    sampled = [j for j, job in enumerate(jobs) if job.resumed is None]
    if not sampled:
        return
    if len(sampled) < len(jobs):  # (an index list uploaded: a pageable one would sync)
        logits = logits[upload(engine.device, torch.tensor(sampled))[0]]
        jobs = [jobs[j] for j in sampled]
    _fan_out(scheduler, jobs)
    taken = [entry for job in jobs for entry in job.requests]
    slots = [slot for job in jobs for slot in job.slots]
    group = [j for j, job in enumerate(jobs) for _ in job.requests]
    lengths = [len(jobs[g].sequence) for g in group]
    max_new = [sub.max_new[r] for sub, r in taken]
    group_dev, seed_lo, seed_hi, row_positions, row_slots, max_new_dev = upload(
        engine.device, torch.tensor(group), torch.tensor([sub.seed_lo[r] for sub, r in taken]),
        torch.tensor([sub.seed_hi[r] for sub, r in taken]), torch.tensor(lengths),
        torch.tensor(slots), torch.tensor(max_new),
    )  # fmt: skip
    first = len(scheduler.rows)
    admission.append_admitted(scheduler, taken, slots, logits[group_dev], seed_lo, seed_hi,
                              row_positions, row_slots, max_new_dev, max_new, lengths)  # fmt: skip
    aborted = {live for live in scheduler.rows[first:] if live.request in live.sub.aborted}
    if aborted:  # aborted while its prompt's other samples were still being prefilled
        scheduler.retire(aborted)


def _fan_out(scheduler: SchedulerState, jobs: list[PrefillJob]) -> None:
    """Each job's prompt K/V from its first slot to its other samples' (n > 1): every
    position in a slot cache, the partial last block in a paged one (its full blocks are
    shared: Paging.place); the per-sequence state (a recurrent layer's) once per sample."""
    pairs = [(job.slots[0], slot) for job in jobs for slot in job.slots[1:]]
    if pairs and scheduler.cache.per_sequence:
        src, dst = upload(scheduler.engine.device, *torch.tensor(pairs).T)
        scheduler.cache.copy_sequences(src, dst)
    if scheduler.paging is not None:
        for job in jobs:
            if job.copies is not None:
                src, src_at, dst, dst_at = upload(scheduler.engine.device, *job.copies)
                scheduler.cache.copy_entries((src, src_at), (dst, dst_at))
        return
    fanned = [(job.slots[0], slot, len(job.sequence)) for job in jobs for slot in job.slots[1:]]
    if not fanned:
        return
    lengths = torch.tensor([length for _, _, length in fanned])
    src = torch.repeat_interleave(torch.tensor([s for s, _, _ in fanned]), lengths)
    dst = torch.repeat_interleave(torch.tensor([d for _, d, _ in fanned]), lengths)
    src, dst, at = upload(scheduler.engine.device, src, dst, ranges(lengths))
    scheduler.cache.copy_entries((src, at), (dst, at))
