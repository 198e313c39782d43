"""Compiling Triton kernels for an H100/H200 (sm_90) target in worker processes, on a
machine without a GPU (tests/engine/kernels/test_kernel_compile.py). Each compile is
seconds of CPU that holds the GIL (threads do not overlap them), and the suite runs one
test at a time: a pool of processes puts the other cores to work."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import traceback
from concurrent.futures import Future, ProcessPoolExecutor

MAX_WORKERS = 4
"""More workers than this cost more in imports (~2 s of CPU each) than their compiles gain."""


def compile_to_ptx(module: str, name: str, signature: dict, constexprs: dict, attrs: dict,
                   options: dict) -> tuple[bool, str]:  # fmt: skip
    """(True, the PTX) of ``module.name`` compiled for sm_90, or (False, the compiler's
    traceback): a Triton error need not survive pickling to be read in the test."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), name)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception:  # noqa: BLE001 - reported by the test that asked for it
        return False, traceback.format_exc()
    return True, compiled.asm["ptx"]


class Compiled:
    """A kernel compiling in the pool; ``asm["ptx"]`` waits for it. A failed compile fails
    the test reading it, with the compiler's traceback."""

    def __init__(self, future: Future, what: str) -> None:
        self.future, self.what = future, what

    @property
    def asm(self) -> dict[str, str]:
        ok, text = self.future.result()
        assert ok, f"{self.what} did not compile for sm_90:\n{text}"
        assert text, f"{self.what} compiled to no PTX"
        return {"ptx": text}


def compile_pool() -> ProcessPoolExecutor:
    """Workers for :func:`compile_to_ptx`, one per core up to MAX_WORKERS ("spawn": the
    test process holds torch's threads, which a fork would copy mid-state)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(MAX_WORKERS, cores or 1))
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
