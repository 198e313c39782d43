"""Reading decode results back without stalling the GPU: copies of the live rows' flags,
counts and newest tokens queued after a chunk of steps (pinned host memory on CUDA), read by
the host a chunk later (scheduler.py, EngineOptions.sync_lag): each request's lists extended,
finished rows retired."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridflow.engine.host import collect_young
from hybridflow.engine.requests import LiveRequest
from hybridflow.engine.state import DecodeState

if TYPE_CHECKING:
    from hybridflow.engine.scheduling.state import SchedulerState


@dataclass
class Snapshot:
    """Copies of the decode state queued right after a chunk of steps (pinned host memory on
    CUDA), read by the host one chunk later. Rows are in the order of `requests`."""

    requests: list[LiveRequest]
    finished: torch.Tensor  # [rows] bool
    generated: torch.Tensor  # [rows] tokens generated so far
    tokens: torch.Tensor  # [rows, W]: the last W output columns up to `generated`
    logprobs: torch.Tensor  # [rows, W]
    ready: object  # torch.cuda.Event, or None on CPU

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def take_snapshot(state: DecodeState, requests: list[LiveRequest], window: int,
                  columns: torch.Tensor) -> Snapshot:  # fmt: skip
    """Queue copies of the first len(requests) rows' flags, counts and last `window` output
    columns (`columns`: arange(window) on the state's device)."""
    rows = len(requests)
    generated = state.generated[:rows]
    wanted = (generated[:, None] - window + columns[None, :]).clamp_(min=0)
    slots = state.row_slots[:rows, None]
    parts = [state.finished[:rows], generated, state.out_tokens[slots, wanted],
             state.out_logprobs[slots, wanted]]  # fmt: skip
    ready = None
    if state.tokens.is_cuda:
        host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts]
        for h, p in zip(host, parts):
            h.copy_(p, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        parts = host
    else:
        parts = [p.clone() for p in parts]
    return Snapshot(list(requests), *parts, ready)


def queue_snapshot(scheduler: SchedulerState) -> Snapshot:
    """Queue copies of the live rows' flags, counts and newest tokens."""
    return take_snapshot(scheduler.state, scheduler.rows, scheduler.window, scheduler.columns)


def absorb(scheduler: SchedulerState, snapshot: Snapshot) -> None:
    """Append a snapshot's new tokens to each request's lists; retire finished rows."""
    collect_young(snapshot.ready)  # while the GPU is still busy, if there is work for it
    snapshot.wait()
    scheduler.read_after = snapshot.ready
    finished = snapshot.finished.tolist()
    generated = snapshot.generated.tolist()
    tokens, logprobs = snapshot.tokens.tolist(), snapshot.logprobs.tolist()
    width = scheduler.window
    extra_stops = scheduler.extra_stops
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
                    # unless the device stopped it there too, it steps on past the cut
                    live.overran = not (finished[row] and cut + 1 == len(new_tokens))
                    new_tokens, new_logprobs = new_tokens[: cut + 1], new_logprobs[: cut + 1]
                    done.add(live)
            live.tokens.extend(new_tokens)
            live.logprobs.extend(new_logprobs)
            if live.sub.listener is not None:
                live.sub.listener(live.request, new_tokens, new_logprobs)
        if finished[row]:
            done.add(live)
    if done:
        scheduler.retire(done)


def flush(scheduler: SchedulerState) -> None:
    """Read back everything the device has generated (before a pause, a weight update or a
    preemption: afterwards each live request's lists hold all of its tokens)."""
    if scheduler.pending is not None:
        absorb(scheduler, scheduler.pending)
        scheduler.pending = None
    if scheduler.rows:
        absorb(scheduler, queue_snapshot(scheduler))
