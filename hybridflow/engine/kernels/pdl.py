"""Programmatic dependent launch (PDL) and L2 prefetch for the decode kernels (sm_90+).

Why: a decode step at 256 rows is ~200 kernels of a few microseconds each, and
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

Kernels take a `PDL: tl.constexpr = False` and are launched with `**launch.keywords()`. Kernels without PDL (cuBLAS, torch ops) keep plain stream order.
"""

from __future__ import annotations

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


# Bytes one matmul may prefetch in all (the H200's L2 is 50 MB): prefetching a whole 55 MB
# weight thrashed L2 and cost 10% end to end; the start of each program's stream is what the
# overlap needs (docs/engine.md, Programmatic dependent launch).
WEIGHT_PREFETCH_BYTES = 24 << 20


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
