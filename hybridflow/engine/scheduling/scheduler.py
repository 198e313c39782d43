"""The host side of generation: requests waiting for a slot, live rows, their budgets and the
tokens read back so far. One Scheduler lives as long as the engine's cache: generate() runs
it until its submission is done; the rollout service (service.py) runs it on its own thread
while requests come and go.

Each step: admit waiting requests into free slots (one packed prefill per unique prompt, its
KV fanned out to the n sample slots, first tokens sampled), queue a chunk of decode steps
(graph replays, no host sync) and pinned copies of the rows' flags and newest tokens; then
read the previous chunk's copies (EngineOptions.sync_lag) while the GPU runs this chunk:
extend each request's lists, retire finished requests, free and compact their rows. So
requests join at a step's admission and leave at its read-back, between chunks.

Rows of different submissions share the batch. Their sampling settings may differ (one
setting: the specialised sampler; several: row_sampling.py), and so may their stop tokens:
the device stops a row on the tokens every live submission stops on, the host on the rest
(at read-back; the row decodes at most a chunk past its stop, and the surplus is cut).

With EngineOptions.max_prefill_tokens_per_step > 0 (mixed.py), admitted prompts and
continuations are prefill jobs instead, run a chunk per step in the same forward as the live
rows' next tokens; a step with no job queues a chunk of decode steps as above.

In a paged cache (paging.py) admission also needs free blocks, each chunk first grows the
rows' blocks, and a shortage preempts the newest requests (preemption.py), which wait in
`resuming` and come back before any new request is admitted.

The steps are modules of their own (admission.py, continuation.py, mixed.py, preemption.py,
readback.py), functions over the state they share (state.py: the queues, rows and counters);
the Scheduler composes them and none of them imports it.
"""

from __future__ import annotations

import time

from hybridflow.engine.host import upload
from hybridflow.engine.requests import Completion, Submission
from hybridflow.engine.scheduling import (
    admission,
    continuation,
    mixed,
    preemption,
    readback,
    step_log,
    tail,
)
from hybridflow.engine.scheduling.readback import Snapshot
from hybridflow.engine.scheduling.state import SchedulerState


class Scheduler(SchedulerState):
    """The steps over one engine cache's requests (module docstring); the queues, rows and
    counters they act on are its SchedulerState (state.py)."""

    # -- requests in and out --------------------------------------------------------------------

    def add(self, sub: Submission) -> None:
        """Queue a submission's requests; those naming a kept slot their prompt extends
        continue in it (kept.py), the rest wait for a free slot."""
        sub.queued_at = self.steps
        if sub.reuse is None:
            self.waiting.extend((sub, request) for request in range(len(sub.max_new)))
            return
        vision = self.engine.config.vision if self.engine.vision else None
        image_token = None if vision is None else vision.image_token_id
        for request, handle in enumerate(sub.reuse):
            taken = self.engine.kept.take(handle, sub.prompts[request])
            if taken is not None and not continuation.extends_text_only(
                sub, request, taken[1], image_token
            ):  # new images: the encoder runs in a full prefill (continuation.py)
                self.free_slot(taken[0])  # its K/V are not continued
                taken = None
            if taken is None:
                self.waiting.append((sub, request))
            else:
                self.extending.append((sub, request, *taken))

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.extending or self.rows or self.resuming
                    or self.prefilling or self.pending is not None)  # fmt: skip

    def submissions(self) -> set[Submission]:
        """Every submission with a request here (live, waiting, extending or preempted)."""
        subs = {live.sub for live in self.rows} | {live.sub for live in self.resuming}
        subs |= {sub for job in self.prefilling for sub, _ in job.requests}
        return subs | {entry[0] for entry in self.waiting} | {e[0] for e in self.extending}

    def run(self, sub: Submission) -> list[Completion]:
        """Serve one submission to the end (generate(): nothing else is queued)."""
        self.add(sub)
        while not sub.done:
            self.step()
        if not self.rows:
            self.pending = None  # holds only finished requests
        return sub.results

    def abort(self, sub: Submission, request: int) -> None:
        """End a request now: with the tokens read back so far, finish_reason 'abort'."""
        if sub.results[request] is not None:
            return
        sub.aborted.add(request)
        for live in self.rows:
            if live.sub is sub and live.request == request:
                self.retire({live})
                return
        if mixed.abort(self, sub, request):
            return
        for entry in list(self.extending):
            if entry[0] is sub and entry[1] == request:
                self.extending.remove(entry)
                self.free_slot(entry[2])
        for live in list(self.resuming):
            if live.sub is sub and live.request == request:
                self.resuming.remove(live)
                sub.finish(request, Completion(live.tokens, live.logprobs, "abort",
                                               version_spans=tuple(live.spans)))  # fmt: skip
                return
        if (sub, request) in self.waiting:
            self.waiting.remove((sub, request))
        sub.finish(request, Completion([], [], "abort", version_spans=((0, self.version),)))

    def capture_graphs(self) -> int:
        """Every batch bucket's decode graph of the current sampling mode, and the static
        mixed steps' (static_step.py) and verify passes' (speculative/static_verify.py)
        where they run, captured now. -> how many were new."""
        captured = self.runner.capture_all()
        if self.static_step is not None:
            captured += self.static_step.capture_all()
        if self.static_verify is not None:
            captured += self.static_verify.capture_all()
        return captured

    def release_kept(self, handles) -> None:
        for slot in self.engine.kept.release(handles):
            self.free_slot(slot)

    def drop_kept(self) -> None:
        """Every kept slot back (new weights made their K/V stale); continuations waiting
        for their kept slot are prefilled in full instead."""
        self.release_kept(list(self.engine.kept.handles()))
        while self.extending:
            sub, request, slot, _ = self.extending.popleft()
            self.free_slot(slot)
            self.waiting.appendleft((sub, request))

    def flush(self) -> None:
        """Read back everything the device has generated (before a pause or weight update:
        afterwards each live request's lists hold all of its tokens)."""
        readback.flush(self)

    def new_version(self, version: int) -> None:
        """Tokens sampled from now on come from policy `version` (call after flush())."""
        self.version = version
        resumed = [job.resumed for job in self.prefilling if job.resumed is not None]
        for live in [*self.rows, *self.resuming, *resumed]:
            if live.spans[-1][0] == len(live.tokens):
                live.spans[-1] = (len(live.tokens), version)
            else:
                live.spans.append((len(live.tokens), version))

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> None:
        """Admit, queue a chunk of decode steps, read back the previous chunk."""
        # Admit until the slots or the queue run out (several prefill passes back to back):
        # rows admitted later would otherwise trail the first ones by a whole chunk of steps
        # at a smaller batch (an H200 profile of 256 prompts showed 15 steps at 128 rows).
        started = time.perf_counter()
        before = None if self.step_log is None else step_log.counters(self)
        self.steps += 1
        if self.mixed:
            mixed.open_jobs(self)
        else:
            self._admit()
        tail_rows = self.engine.options.speculative_max_rows
        in_tail = tail.in_tail(len(self.rows), bool(self.prefilling), tail_rows)
        plain_before = self.plain_decode_steps
        speculation = self.engine.speculation
        if in_tail and speculation is not None:  # the measured rule times its tail steps
            speculation.rule.step_started(speculation.stats)
        if self.prefilling:  # one forward: a step of the rows and chunks of the prompts
            steps = mixed.run_step(self)
        else:
            steps = min(self.engine.steps_per_sync, max(self.row_budget, default=0))
            if steps > 0 and self.engine.speculation is not None:
                steps = self._verify_or_decode(steps)
            elif steps > 0:
                self._decode(steps)
        snapshot = None
        if self.rows and (steps > 0 or self.pending is None):
            snapshot = self._snapshot()
        if self.pending is not None:
            self._absorb(self.pending)  # the GPU runs the chunk just queued meanwhile
        # Nothing queued to overlap with and no row left to decode: read it now. Rows that
        # may decode (a prefill step's new rows) are read while the next step runs.
        if snapshot is not None and (
            not self.lagged or (steps == 0 and max(self.row_budget, default=0) <= 0)
        ):
            self._absorb(snapshot)
            self.drains += 1
            snapshot = None
        self.pending = snapshot
        if in_tail:  # the step's wall time: its chunk queued, the previous one read back
            clock, seconds = self.engine.tail, time.perf_counter() - started
            clock.steps += 1
            clock.seconds += seconds
            clock.decode_steps += self.plain_decode_steps - plain_before
            if speculation is not None:
                speculation.rule.step_ended(speculation.stats, seconds,
                                            self.plain_decode_steps - plain_before)  # fmt: skip
        if before is not None:
            self.step_log.append(step_log.record(self, before))

    def _admit(self) -> None:
        """Prefill and extend passes of their own, before the chunk of decode steps."""
        while self.resuming and preemption.can_resume(self):
            preemption.resume(self)
        while self.extending and self._ready(self.extending) and preemption.extension_fits(self):
            continuation.admit(self)
        while self.waiting and not self.resuming and self._should_admit() and admission.admit(self):
            pass

    def _decode(self, steps: int) -> None:
        if self.subs_changed:
            self.sync_submissions()
        if self.paging is not None:
            steps = preemption.make_room(self, steps)
            if not steps:
                return
        if self.groups_changed and self.runner.shared:
            self._upload_groups()
        self.runner.decode_steps(len(self.rows), steps, self.max_live_len(steps))
        self.decode_steps += steps
        self.plain_decode_steps += steps
        self.decoded_rows += steps * len(self.rows)
        self.row_budget = [b - steps for b in self.row_budget]

    def _verify_or_decode(self, steps: int) -> int:
        """Speculation on (speculative/verify.py): a verify pass while few rows decode, the
        rule finds it pays and some row has a draft; else the chunk of decode steps (its rows
        maybe read back first; one step when it probes a decode step's time). -> the steps
        run."""
        from hybridflow.engine.speculative import verify

        if verify.run_step(self):
            return 1
        steps = min(
            self.engine.speculation.rule.plain_steps(steps), max(self.row_budget, default=0)
        )
        if steps > 0:
            self._decode(steps)
        return steps

    def _should_admit(self) -> bool:
        # Prefill in batches: wait until a useful share of the slots is free (amortises the
        # eager prefill) unless nothing is decoding or the queue is short.
        free = len(self.free_slots)
        want = min(len(self.waiting), max(1, self.cache.num_slots // 8))
        while free < want and len(self.engine.kept):  # kept KV gives way, oldest first
            self.free_slot(self.engine.kept.evict_oldest())
            free += 1
        if self.paging is not None and not preemption.blocks_for_next(self):
            return False
        return free > 0 and (not self.rows or (free >= want and self._ready(self.waiting)))

    def _ready(self, queue) -> bool:
        """Whether a queue's requests go in now rather than wait for company (prefill passes
        are a fixed cost each: options.admission_wait_chunks): yes when nothing decodes, an
        eighth of the slots' worth waits, or its oldest request has waited long enough."""
        if not self.rows or len(queue) >= max(1, self.cache.num_slots // 8):
            return True
        return self.steps - queue[0][0].queued_at > self.engine.options.admission_wait_chunks

    # -- reading back ---------------------------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        return readback.queue_snapshot(self)

    def _absorb(self, snapshot: Snapshot) -> None:
        readback.absorb(self, snapshot)

    def _upload_groups(self) -> None:
        """The live rows' shared-prefix groups into the state (rows changed): queued before
        the next decode chunk, which reads them (shared_prefix.py)."""
        from hybridflow.engine.kernels.shared_prefix import group_table

        self.groups_changed = False
        keys, lengths = [], []
        for live, admitted in zip(self.rows, self.row_admission):
            prompt = live.request // live.sub.n
            keys.append((id(live.sub), prompt, admitted))
            lengths.append(int(live.sub.table.lengths[prompt]))
        groups, first = group_table(keys, lengths, [live.slot for live in self.rows],
                                    self.state.capacity)  # fmt: skip
        groups_dev, first_dev = upload(self.engine.device, groups, first)
        self.state.prefix_groups.copy_(groups_dev.view(-1, 4))
        self.state.prefix_first.copy_(first_dev)
