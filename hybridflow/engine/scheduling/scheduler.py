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
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from hybridflow.engine.host import collect_young, upload
from hybridflow.engine.requests import Completion, LiveRequest, Submission
from hybridflow.engine.row_sampling import mixed_mode
from hybridflow.engine.scheduling import admission, continuation, mixed, preemption
from hybridflow.engine.scheduling.readback import Snapshot, take_snapshot

if TYPE_CHECKING:
    from hybridflow.engine.engine import Engine


class Scheduler:
    """Waiting requests, live rows and free slots of one engine cache (module docstring)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.state, self.runner, self.cache = engine.state, engine.runner, engine.cache
        self.waiting: deque[tuple[Submission, int]] = deque()
        # requests continuing a kept slot: (submission, request, slot, cached length)
        self.extending: deque[tuple[Submission, int, int, int]] = deque()
        kept = engine.kept.slots()
        self.free_slots = [s for s in range(self.cache.num_slots - 1, -1, -1) if s not in kept]
        # a paged cache's blocks (paging.py); a new scheduler frees all but the kept ones
        self.paging = None
        if engine.blocks is not None:
            from hybridflow.engine.scheduling.paging import Paging

            self.paging = Paging(engine.blocks, self.cache, engine.device)
            for slot in self.free_slots:
                self.paging.release(slot)
        self.resuming: deque[LiveRequest] = deque()  # preempted, to prefill again (paging.py)
        # mixed steps (mixed.py): prompts and continuations prefilled a chunk per step
        self.mixed = engine.options.max_prefill_tokens_per_step > 0
        self.prefilling: list[mixed.PrefillJob] = []
        self.rows: list[LiveRequest] = []  # the request of each live row
        self.row_budget: list[int] = []  # upper bound on steps each row may still take
        self.row_end: list[int] = []  # prompt length + max_new: bound on the row's cache length
        self.row_admission: list[int] = []  # which admission prefilled each row's prompt
        self.admissions = 0
        self.steps = 0  # step() calls so far (a clock for how long requests have waited)
        self.decode_steps = 0  # steps run, and rows decoded summed over them (their ratio: the
        self.decoded_rows = 0  # mean batch, a counter of how well requests share steps)
        self.mixed_steps = 0  # steps whose forward carried decode rows and prompt chunks
        self.pending: Snapshot | None = None
        self.version = 0  # the policy version sampling now (new_version)
        self.live_subs: dict[Submission, int] = {}  # live rows per submission
        self.device_stop: frozenset | None = None  # the stop ids on the device now
        self.extra_stops: dict[Submission, frozenset] = {}  # stop ids the host checks
        self.subs_changed = True  # live_subs gained or lost a member: stops, mode
        self.groups_changed = False  # rows changed: shared-prefix groups
        # output columns a snapshot reads per row: a chunk's steps + the admission's token
        self.window = engine.steps_per_sync + 1
        self.columns = torch.arange(self.window, device=engine.device)
        # Host reads lag the device by one chunk: the next chunk's replays are queued before
        # the host waits for the previous chunk's flags and tokens, so the GPU does not idle
        # while the host compacts rows, admits prompts and turns tokens into lists (H200,
        # 0.5b: 171k vs 162k tok/s at 256 rows, 242k vs 227k at 1024).
        self.lagged = engine.sync_lag > 0
        # routing replay: finished requests' expert ids from the cache's record (routes.py),
        # read after the last snapshot's event (every position they need is written by then)
        self.route_reader = None
        if self.cache.routes is not None:
            from hybridflow.engine.scheduling.routes import RouteReader

            self.route_reader = RouteReader(self.cache, engine.device)
        self.read_after = None  # the last absorbed snapshot's event

    # -- requests in and out --------------------------------------------------------------------

    def add(self, sub: Submission) -> None:
        """Queue a submission's requests; those naming a kept slot their prompt extends
        continue in it (kept.py), the rest wait for a free slot."""
        sub.queued_at = self.steps
        if sub.reuse is None:
            self.waiting.extend((sub, request) for request in range(len(sub.max_new)))
            return
        for request, handle in enumerate(sub.reuse):
            taken = self.engine.kept.take(handle, sub.prompts[request])
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

    def free_slot(self, slot: int) -> None:
        self.free_slots.append(slot)
        if self.paging is not None:
            self.paging.release(slot)

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
        if self.pending is not None:
            self._absorb(self.pending)
            self.pending = None
        if self.rows:
            self._absorb(self._snapshot())

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
        self.steps += 1
        if self.mixed:
            mixed.open_jobs(self)
        else:
            self._admit()
        if self.prefilling:  # one forward: a step of the rows and chunks of the prompts
            steps = mixed.run_step(self)
        else:
            steps = min(self.engine.steps_per_sync, max(self.row_budget, default=0))
            if steps > 0:
                self._decode(steps)
        snapshot = None
        if self.rows and (steps > 0 or self.pending is None):
            snapshot = self._snapshot()
        if self.pending is not None:
            self._absorb(self.pending)  # the GPU runs the chunk just queued meanwhile
        if snapshot is not None and (not self.lagged or steps == 0):
            self._absorb(snapshot)  # nothing queued to overlap with: read it now
            snapshot = None
        self.pending = snapshot

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
        self.runner.decode_steps(len(self.rows), steps, self._max_live_len(steps))
        self.decode_steps += steps
        self.decoded_rows += steps * len(self.rows)
        self.row_budget = [b - steps for b in self.row_budget]

    def sync_submissions(self) -> None:
        """The live submissions changed: the device's stop ids (those every one of them
        stops on), the host's extra checks, and the sampling mode of the decode steps."""
        subs = list(self.live_subs)
        self.subs_changed = False
        if not subs:
            return
        common = frozenset.intersection(*(sub.stop_ids for sub in subs))
        if common != self.device_stop:
            self.state.set_stop_tokens(sorted(common))
            self.device_stop = common
        self.extra_stops = {sub: sub.stop_ids - common for sub in subs if sub.stop_ids != common}
        modes = {sub.mode: sub.params for sub in subs}
        mode = next(iter(modes.values())) if len(modes) == 1 else mixed_mode(modes)
        engine = self.engine
        shared = engine.shares_prefixes(max(sub.n for sub in subs))
        if shared and not self.runner.shared:
            self.groups_changed = True
        self.runner.set_mode(mode, shared=shared)

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

    def _max_live_len(self, steps: int) -> int:
        """Host upper bound on cache positions read during the next `steps` steps (eager torch
        decode reads only these); no device sync needed."""
        bound = max(end - budget + steps for end, budget in zip(self.row_end, self.row_budget))
        return min(self.cache.max_seq_len, bound)

    # -- reading back ---------------------------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        return take_snapshot(self.state, self.rows, self.window, self.columns)

    def _absorb(self, snapshot: Snapshot) -> None:
        """Append a snapshot's new tokens to each request's lists; retire finished rows."""
        collect_young(snapshot.ready)  # while the GPU is still busy, if there is work for it
        snapshot.wait()
        self.read_after = snapshot.ready
        finished = snapshot.finished.tolist()
        generated = snapshot.generated.tolist()
        tokens, logprobs = snapshot.tokens.tolist(), snapshot.logprobs.tolist()
        width = self.window
        extra_stops = self.extra_stops
        done = set()
        for row, live in enumerate(snapshot.requests):
            if live.done:  # retired by an earlier snapshot
                continue
            new = generated[row] - len(live.tokens)
            if new > 0:
                new_tokens, new_logprobs = tokens[row][width - new :], logprobs[row][width - new :]
                extra = extra_stops.get(live.sub)
                if extra:  # a stop id only this submission has: cut there
                    cut = next((i for i, t in enumerate(new_tokens) if t in extra), None)
                    if cut is not None:
                        new_tokens, new_logprobs = new_tokens[: cut + 1], new_logprobs[: cut + 1]
                        done.add(live)
                live.tokens.extend(new_tokens)
                live.logprobs.extend(new_logprobs)
                if live.sub.listener is not None:
                    live.sub.listener(live.request, new_tokens, new_logprobs)
            if finished[row]:
                done.add(live)
        if done:
            self.retire(done)

    def retire(self, done: set[LiveRequest], preempt: bool = False) -> None:
        """Record finished requests' results, free their slots and compact the live rows.
        preempt: the rows are not done; they free their slots and wait in `resuming`."""
        records = {} if preempt else self._read_routes(done)
        keep = []
        for row, live in enumerate(self.rows):
            if live not in done:
                keep.append(row)
                continue
            sub = live.sub
            self.live_subs[sub] -= 1
            if not self.live_subs[sub]:
                del self.live_subs[sub]
                self.subs_changed = True
            if preempt:
                self.free_slot(live.slot)
                self.resuming.append(live)
                continue
            live.done = True
            tokens = live.tokens
            aborted = live.request in sub.aborted
            handle = None
            if sub.keep and not aborted:  # the slot holds the prompt and every token but the last
                handle = self.engine.kept.keep(
                    live.slot, [*sub.prompt_of(live.request), *tokens[:-1]]
                )
            else:
                self.free_slot(live.slot)
            reason = (
                "abort" if aborted else "stop" if tokens and tokens[-1] in sub.stop_ids
                else "length"
            )  # fmt: skip
            sub.finish(live.request, Completion(tokens, live.logprobs, reason, handle,
                                                tuple(live.spans), records.get(live)))  # fmt: skip
        self.state.keep_rows(keep, upload(self.engine.device, torch.tensor(keep))[0])
        self.rows = [self.rows[r] for r in keep]
        self.row_budget = [self.row_budget[r] for r in keep]
        self.row_end = [self.row_end[r] for r in keep]
        self.row_admission = [self.row_admission[r] for r in keep]
        self.groups_changed = True

    def _read_routes(self, done: set[LiveRequest]) -> dict:
        """Each finished request's routing record (routes.py), {} without one."""
        if self.route_reader is None or not done:
            return {}
        lives = [live for live in self.rows if live in done]
        lengths = [len(live.sub.prompt_of(live.request)) + max(len(live.tokens) - 1, 0)
                   for live in lives]  # fmt: skip
        # a request retired before any of its tokens was read back (an abort) may have been
        # prefilled after the last snapshot: wait for all work queued so far
        after = self.read_after if all(live.tokens for live in lives) else None
        records = self.route_reader.read([live.slot for live in lives], lengths, after)
        return dict(zip(lives, records))

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
