"""Where scorer calls run: the project's own scorers in this process (with
``num_workers`` 0), everything else in reward worker processes the trainer owns.

A user's reward function (reward.custom_fn, or a scorer registered from outside hybridflow)
never runs in the trainer: whatever it does there (``os._exit``, a segfault, closing
stdout, printing megabytes, returning an object that cannot be sent) ends as counted
failures of the samples it was scoring, never as the end of the run. ``num_workers``
processes score (at least one for user code); each runs its chunk of calls concurrently
with a per-call timeout (rewards/parallel.py's run_chunk).

The trainer waits for a chunk at most ``startup_grace_s`` + the per-call timeout × its
calls; a worker still busy then (stuck in C code that ignores signals) is killed and its
calls time out. A worker that dies fails its chunk's calls with a message saying how it
ended; a new one starts for the next chunk.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from hybridflow.rewards.parallel import Call, ScoreOutcome, run_chunk
from hybridflow.rewards.scorer_registry import ScorerSpec
from hybridflow.rewards.worker_process import MAX_VALUE_BYTES, RewardWorker, WorkerDied

OUTPUT_CAP_BYTES = 16 * 1024
"""What a worker keeps of the scoring code's stdout/stderr per chunk; the rest is counted."""
PROJECT_SCORERS = "hybridflow."
STATUSES = ("ok", "error", "timeout")


def is_project_scorer(spec: ScorerSpec) -> bool:
    """hybridflow's own scorers may run in the trainer; any other code runs in a worker."""
    return spec.target.startswith(PROJECT_SCORERS)


@dataclass
class ScoringRun:
    """The outcomes of ``ScoringPool.run`` (one per call, in order) and what the workers saw."""

    outcomes: list[ScoreOutcome]
    output: list[tuple[str, str]] = field(default_factory=list)
    """(the scorers of a chunk, the first OUTPUT_CAP_BYTES of what they printed)."""
    output_bytes: int = 0
    output_bytes_dropped: int = 0
    """Printed beyond a chunk's cap: counted, not kept."""
    worker_deaths: int = 0


class ScoringPool:
    """Runs scorer calls; `close()` (or `with`) stops the workers (they start on first use
    and are reused across training steps)."""

    def __init__(self, num_workers: int = 0, timeout_s: float | None = 10.0,
                 startup_grace_s: float = 60.0,
                 output_cap_bytes: int = OUTPUT_CAP_BYTES):  # fmt: skip
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.startup_grace_s, self.output_cap_bytes = startup_grace_s, output_cap_bytes
        self._workers: dict[int, RewardWorker] = {}
        self._lock = threading.Lock()  # one run at a time: the workers are shared

    @property
    def num_processes(self) -> int:
        return max(1, self.num_workers)

    def run(self, calls: Sequence[Call]) -> ScoringRun:
        calls = list(calls)
        here = [i for i, (spec, _) in enumerate(calls)
                if self.num_workers <= 0 and is_project_scorer(spec)]  # fmt: skip
        elsewhere = sorted(set(range(len(calls))) - set(here))
        outcomes: list[ScoreOutcome | None] = [None] * len(calls)
        run = ScoringRun([])
        if elsewhere:
            with self._lock:
                run = self._run_in_workers([calls[i] for i in elsewhere])
            for i, outcome in zip(elsewhere, run.outcomes):
                outcomes[i] = outcome
        if here:
            for i, outcome in zip(here, run_chunk([calls[i] for i in here], self.timeout_s)):
                outcomes[i] = outcome
        run.outcomes = outcomes
        return run

    def check_loads(self, target: str) -> tuple[str, str | None] | None:
        """Import ``target``'s file in a worker: None, or (message, fix) of what went wrong
        (an import error, an exit, a crash, or an import past startup_grace_s)."""
        importing = f"reward.custom_fn: importing {target}"
        with self._lock:
            try:
                worker = self._worker(0)
                worker.send(("load", target))
                if not wait([worker.connection], self.startup_grace_s):
                    self._discard(0)
                    return (f"{importing} took more than {self.startup_grace_s:g}s",
                            "make the file fast to import (no work at import time)")  # fmt: skip
                reply = worker.receive(4 * MAX_VALUE_BYTES)
            except WorkerDied as death:
                self._discard(0)
                return (f"{importing} ended the reward worker process ({death})",
                        "a reward file must not exit or crash when imported")  # fmt: skip
        if reply == ("loaded",):
            return None
        if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "load_error":
            return str(reply[1]), None if reply[2] is None else str(reply[2])
        return f"{importing} gave no answer the trainer can read", None

    def _worker(self, slot: int) -> RewardWorker:
        if slot in self._workers and self._workers[slot].process.poll() is not None:
            self._discard(slot)  # ended while idle (killed from outside): none of its calls failed
        if slot not in self._workers:
            self._workers[slot] = RewardWorker(self.output_cap_bytes)
        return self._workers[slot]

    def _discard(self, slot: int) -> None:
        """Kill the worker of ``slot`` (dead, hung or stale); the next use starts another."""
        worker = self._workers.pop(slot, None)
        if worker is not None:
            worker.kill()

    def _chunks(self, size: int) -> list[tuple[int, int]]:
        # With a timeout, one chunk per worker: its calls run concurrently there (run_chunk),
        # so hanging calls time out together. Without one, a few chunks per worker: a slow
        # chunk does not leave the other workers idle for long.
        chunks_per_worker = 1 if self.timeout_s else 4
        chunk_size = max(1, math.ceil(size / (chunks_per_worker * self.num_processes)))
        return [(s, min(chunk_size, size - s)) for s in range(0, size, chunk_size)]

    def _limit_s(self, size: int) -> float:
        """How long a chunk of ``size`` calls may take (no bound without a timeout)."""
        if not self.timeout_s:
            return math.inf
        return self.startup_grace_s + self.timeout_s * size

    def _run_in_workers(self, calls: list[Call]) -> ScoringRun:
        run = ScoringRun([None] * len(calls))
        queue, busy = deque(self._chunks(len(calls))), {}  # busy: slot -> (start, size, end)
        try:
            while queue or busy:
                for slot in range(self.num_processes):
                    if slot not in busy and queue:
                        self._start_chunk(slot, queue.popleft(), calls, busy, run)
                self._finish_chunks(calls, busy, run)
        except BaseException:  # Ctrl-C, a stop: the busy workers' answers would be stale
            for slot in busy:
                self._discard(slot)
            raise
        return run

    def _start_chunk(self, slot, chunk, calls, busy, run: ScoringRun) -> None:
        start, size = chunk
        # busy before the send: a Ctrl-C landing right after it (a scorer that signals its
        # parent at once) must still discard this worker, or its stale answer would be read
        # as the next run's, after the scorer's whole call
        busy[slot] = (start, size, time.monotonic() + self._limit_s(size))
        try:
            self._worker(slot).send(("score", calls[start : start + size], self.timeout_s))
        except WorkerDied as death:
            del busy[slot]
            self._record_death(slot, chunk, calls, death, run)

    def _finish_chunks(self, calls, busy, run: ScoringRun) -> None:
        """Wait for the first answers (or the first deadline) and record them."""
        if not busy:
            return
        soonest = min(end for _, _, end in busy.values())
        timeout = None if soonest == math.inf else max(0.0, soonest - time.monotonic())
        by_connection = {self._workers[slot].connection: slot for slot in busy}
        for connection in wait(list(by_connection), timeout):
            slot = by_connection[connection]
            start, size, _ = busy.pop(slot)
            limit = size * (MAX_VALUE_BYTES + 4096) + self.output_cap_bytes + (1 << 20)
            try:
                self._record_answer(self._workers[slot].receive(limit), (start, size), calls, run)
            except WorkerDied as death:
                self._record_death(slot, (start, size), calls, death, run)
        now = time.monotonic()
        for slot, (start, size, end) in list(busy.items()):
            if now >= end:
                del busy[slot]
                self._discard(slot)
                message = (f"scorer {_names(calls[start : start + size])} did not finish in "
                           f"{self._limit_s(size):g}s; its worker was stopped")  # fmt: skip
                run.outcomes[start : start + size] = [
                    ScoreOutcome("timeout", message=message)
                ] * size

    def _record_answer(self, answer, chunk, calls, run: ScoringRun) -> None:
        start, size = chunk
        try:
            kind, outcomes, text, written, dropped = answer
            outcomes = [ScoreOutcome(str(status), value, str(message))
                        for status, value, message in outcomes]  # fmt: skip
            if (kind != "scored" or len(outcomes) != size
                    or any(o.status not in STATUSES for o in outcomes)):  # fmt: skip
                raise ValueError(kind)
        except (TypeError, ValueError) as error:
            raise WorkerDied(f"sent an answer that is not a chunk's scores ({error})") from None
        run.outcomes[start : start + size] = outcomes
        if text:
            run.output.append((_names(calls[start : start + size]), str(text)))
        run.output_bytes += int(written)
        run.output_bytes_dropped += int(dropped)

    def _record_death(self, slot, chunk, calls, death: WorkerDied, run: ScoringRun) -> None:
        start, size = chunk
        self._discard(slot)
        run.worker_deaths += 1
        message = (f"scorer {_names(calls[start : start + size])}: the reward worker process "
                   f"{death} while scoring (a reward function must return a score, not exit "
                   "or crash); its samples score 0 and a new worker starts")  # fmt: skip
        run.outcomes[start : start + size] = [ScoreOutcome("error", message=message)] * size

    def close(self) -> None:
        with self._lock:
            for slot in list(self._workers):
                worker = self._workers.pop(slot)
                with contextlib.suppress(OSError):
                    worker.close()

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _names(calls: Sequence[Call]) -> str:
    """The scorer targets of some calls, for messages."""
    return ", ".join(sorted({spec.target for spec, _ in calls}))
