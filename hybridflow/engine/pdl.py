"""Programmatic dependent launch (PDL) and L2 prefetch for the decode kernels (sm_90+).

Why: a decode step at 256 rows is ~200 kernels of a few microseconds each (NOTES.md), and
inside a CUDA graph each one still waits for the previous one to drain, then pays its own
launch and ramp-up before its first load. With PDL a kernel may be launched while the one
before it is still running; it blocks in `gdc_wait` (griddepcontrol.wait) until that kernel
has finished and its writes are visible. What a kernel does before the wait overlaps the
previous kernel: here, prefetching into L2 what it will read that no recent kernel writes
(a matmul's weights; attention's cached keys and values of earlier steps).

The rules every kernel launched with PDL follows (else results race):
- Before `wait`: only reads of data no kernel of the last two launches writes. Kernel N
  starts at the earliest when every program of kernel N-1 has called `launch_dependents`,
  which they do right after their own wait, so kernel N-2 has finished by then; weights
  and cache positions of earlier steps qualify, activations do not.
- `wait` is called by every program, before any other load or any store.
- `launch_dependents` right after the wait (not earlier: the next kernel's programs would
  take SM slots while this kernel's later waves still need them).

Kernels take a `PDL: tl.constexpr = False` and are launched with `**options(tensor)`. Kernels without PDL (cuBLAS, torch ops) keep plain stream order.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    SUPPORTED = True
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    SUPPORTED = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


# None: on wherever supported (CUDA, compute capability >= 9, a Triton with GDC). Benchmarks
# set True/False for A/B runs; graphs captured under one setting keep it.
ENABLED: bool | None = None
# L2 prefetch before the wait (matmul weights, attention's cached K/V); only with PDL.
PREFETCH_WEIGHTS = True
# Off: measured slower end to end (0.5b/256 with the chain: 146k vs 156k tok/s with weights
# only; NOTES.md run 8): attention's programs launch early but their K/V prefetch competes
# with the matmul they overlap, and the pipelined loop hides most of the start anyway.
PREFETCH_KV = False
# Bytes one kernel may prefetch in all (the H200's L2 is 50 MB). Measured (NOTES.md run 8):
# prefetching a whole 67 MB layer of cached K/V (1.5b, 256 rows) or a 55 MB weight thrashes
# L2 and cost 10% end to end; the start of each program's stream is what the overlap needs.
WEIGHT_PREFETCH_BYTES = 24 << 20
KV_PREFETCH_BYTES = 16 << 20


_suspended = 0


@contextlib.contextmanager
def suspended():
    """Plain launches inside (forward.py's split decode path: its cuBLAS matmuls break every
    other link, and PDL measured 0-2.5% slower there, NOTES.md run 8)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


@functools.lru_cache(maxsize=8)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _capable(tensor: torch.Tensor) -> bool:
    """PDL is supported and allowed for kernels on tensor's device (suspended() aside)."""
    if not SUPPORTED or not tensor.is_cuda or ENABLED is False:
        return False
    return _device_supports(tensor.device.index or 0)


def enabled(tensor: torch.Tensor) -> bool:
    """Whether kernels on tensor's device launch with PDL."""
    return not _suspended and _capable(tensor)


_LAUNCH = {"PDL": True, "launch_pdl": True}


def options(tensor: torch.Tensor) -> dict:
    """Launch keywords of a kernel with a `PDL` constexpr: {} where PDL is off (the kernel's
    default), else PDL=True and launch_pdl=True."""
    return dict(_LAUNCH) if enabled(tensor) else {}


def pair_options(tensor: torch.Tensor) -> dict:
    """options() that ignores suspended(): for a pair of kernels that link to each other
    whatever surrounds them (shared_prefix.py's row kernel and prefix kernel)."""
    return dict(_LAUNCH) if _capable(tensor) else {}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """The previous kernel's writes are visible after this; the next kernel may launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs (no data comes back; a hint, never a fault on a
    valid address)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def prefetch_l2_keep(ptrs):
    """prefetch_l2 with L2's evict-last priority: the lines outlive streaming reads (cached
    K/V, loaded evict-first) until their reader comes."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def prefetch_share(ptr, lines, PER_LINE: tl.constexpr):
    """This program's share of prefetching `lines` 128-byte lines from ptr (a contiguous
    tensor, PER_LINE elements a line), split evenly over all programs of the grid."""
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(
        0
    ) + tl.program_id(0)
    per = tl.cdiv(lines, programs)
    lo = pid * per
    hi = tl.minimum(lo + per, lines)
    for l0 in range(lo, hi, 128):
        line = tl.minimum(l0 + tl.arange(0, 128), hi - 1).to(tl.int64)
        prefetch_l2_keep(ptr + line * PER_LINE)
