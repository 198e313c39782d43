"""What the scheduler keeps between steps: the requests of one engine cache, waiting for a
slot, continuing a kept slot (kept.py), preempted (preemption.py), being prefilled a chunk per
step (mixed.py) or live in the decode batch, the free slots, and the counters. The steps
(admission.py, continuation.py, preemption.py, mixed.py, readback.py) act on this object;
the Scheduler (scheduler.py) composes them. Read here what a row, a queue or a counter is.

Besides the queues it knows the engine through EngineView (view.py: what the steps use of
it) and does what every step needs: free a slot, count a submission's live rows and set the
device's stop ids and sampling mode from them, retire rows that finished or make way.
"""

from __future__ import annotations

from collections import deque

import torch

from hybridflow.engine.host import upload
from hybridflow.engine.requests import Completion, LiveRequest, Submission
from hybridflow.engine.row_sampling import mixed_mode
from hybridflow.engine.scheduling.view import EngineView, PrefillJob


class SchedulerState:
    """Waiting requests, live rows and free slots of one engine cache (module docstring)."""

    def __init__(self, engine: EngineView):
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
        self.prefilling: list[PrefillJob] = []
        self.burst_tokens = 0  # tokens of a burst's jobs left to prefill before its rows decode
        # their steps with static shapes, replayed as CUDA graphs (static_step.py), or None
        self.static_step = None
        if self.mixed and engine.options.graph_mixed_steps:
            from hybridflow.engine.scheduling.static_step import static_step_for

            self.static_step = static_step_for(engine)
        # verify passes with static shapes, replayed as CUDA graphs (speculative/
        # static_verify.py: graph_verify_steps), or None (eager passes)
        self.static_verify = None
        if engine.speculation is not None and engine.options.graph_verify_steps:
            from hybridflow.engine.speculative.static_verify import static_verify_for

            self.static_verify = static_verify_for(engine)
        self.rows: list[LiveRequest] = []  # the request of each live row
        self.row_budget: list[int] = []  # upper bound on steps each row may still take
        self.row_end: list[int] = []  # prompt length + max_new: bound on the row's cache length
        self.row_admission: list[int] = []  # which admission prefilled each row's prompt
        self.admissions = 0
        self.steps = 0  # step() calls so far (a clock for how long requests have waited)
        self.decode_steps = 0  # steps run, and rows decoded summed over them (their ratio: the
        self.decoded_rows = 0  # mean batch, a counter of how well requests share steps)
        self.plain_decode_steps = 0  # decode_steps less verify passes and mixed steps
        self.mixed_steps = 0  # steps whose forward carried decode rows and prompt chunks
        self.chunk_tokens = 0  # prompt tokens those steps (and steps of chunks alone) carried
        self.drains = 0  # steps whose results the host read at once (waiting for the device)
        self.step_log = None  # a list of step_log.StepRecord, one per step, when recording
        self.pending = None  # readback.Snapshot of the chunk queued last, not yet read
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
        # a draft model's K/V of the rows it drafts for (speculative/draft_model.py), made at
        # its first draft: freed with the scheduler, like the cache
        self.draft_cache = None

    def free_slot(self, slot: int) -> None:
        self.free_slots.append(slot)
        if self.paging is not None:
            self.paging.release(slot)

    def count_live(self, sub: Submission) -> None:
        """One more live row of `sub`; a submission new to the batch changes the stop ids."""
        if sub not in self.live_subs:
            self.live_subs[sub] = 0
            self.subs_changed = True
        self.live_subs[sub] += 1

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

    def max_live_len(self, steps: int) -> int:
        """Host upper bound on cache positions read during the next `steps` steps (eager torch
        decode reads only these); no device sync needed."""
        bound = max(end - budget + steps for end, budget in zip(self.row_end, self.row_budget))
        return min(self.cache.max_seq_len, bound)

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
            if self.engine.speculation is not None:  # its response drafts for its siblings
                self.engine.speculation.finished(live)
            aborted = live.request in sub.aborted
            handle = None
            # A recurrent state (or a window's ring) moved on with every token the device
            # decoded past a stop only the host checks (K/V past the end are overwritten):
            # such a slot is not kept, and the next turn prefills in full.
            exact = not (live.overran and self.cache.per_sequence)
            if (
                sub.keep and not aborted and exact
            ):  # the slot holds the prompt and every token but the last
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
