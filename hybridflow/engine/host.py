"""Host-side helpers of the scheduler: pausing Python's cyclic collector while the GPU is fed,
and moving index lists to the device without a sync."""

from __future__ import annotations

import contextlib
import gc
import threading

import torch

# Whether the caller of the outermost cyclic_gc_paused() had the collector on (None: not
# inside one). Nested pauses (generate() wraps _generate()) leave it alone. The collector
# is process-wide, so this is too; the lock keeps two threads' pauses from interleaving.
_caller_collects: bool | None = None
_pause_lock = threading.RLock()


@contextlib.contextmanager
def cyclic_gc_paused():
    """Python's cyclic garbage collector off inside (restored after). A full collection walks
    every object of the process (155 ms with torch, transformers and a 0.5b model loaded, on
    a 2-core CPU host): in the middle of generate() it stops the host while the GPU drains the
    one chunk it has queued, and it fired in some timed calls but not others (H200, 0.5b:
    runs of 0.389 vs 0.473 s at 256 rows, 1.07 vs 1.20 s at 1024). The loop's own objects are
    lists of numbers, freed by reference counting; collection resumes when the call returns
    (the young objects are collected while the host waits for the GPU: collect_young)."""
    global _caller_collects
    with _pause_lock:
        outermost = _caller_collects is None
        if outermost:
            _caller_collects = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        if outermost:
            with _pause_lock:
                if _caller_collects:
                    gc.enable()
                _caller_collects = None


def collect_young(gpu_done) -> bool:
    """Run the young-generation collection now if the caller collects, enough young objects
    are waiting, and the GPU is still busy (gpu_done: an event with query(), or None on CPU).
    Why: the result lists (one per request, hundreds of numbers each) all sit in the youngest
    generation while collection is paused, and the first allocation after the call paid for
    walking them: a 9 ms generation-0 pause after a 1024-row call on the H200, inside the
    caller's timing. Collected here, it overlaps GPU work the
    host would otherwise just wait for; the survivors move to an old generation."""
    if (
        not _caller_collects
        or gpu_done is None
        or gc.get_count()[0] < gc.get_threshold()[0]
        or gpu_done.query()
    ):
        return False
    gc.collect(1)
    return True


def ranges(lengths: torch.Tensor) -> torch.Tensor:
    """[n0, n1, ...] -> [0..n0-1, 0..n1-1, ...] (int64, CPU)."""
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)


def upload(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU int64 tensors -> device tensors through one pinned buffer and one non-blocking
    copy. (torch.tensor(list, device="cuda") copies from pageable memory, which waits for the
    GPU to drain: each admission would wait for the previous prefill pass to finish.)"""
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split(sizes))
