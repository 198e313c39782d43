"""Reading decode results back without stalling the GPU: copies of the live rows' flags,
counts and newest tokens queued after a chunk of steps (pinned host memory on CUDA), read by
the host a chunk later (scheduler.py, EngineOptions.sync_lag)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engine.requests import LiveRequest
from hybridflow.engine.state import DecodeState


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
