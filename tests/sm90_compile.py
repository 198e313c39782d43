"""Compiling Triton kernels for an H100/H200 (sm_90) target in worker processes, on a
machine without a GPU (tests/engine/kernels/test_*_compile.py). Each compile is
seconds of CPU that holds the GIL (threads do not overlap them), and the suite runs one
test at a time: a pool of processes puts the other cores to work."""

from __future__ import annotations

import importlib
import inspect
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


INT64_POINTERS = {
    "slot_ptr", "pos_ptr", "targets_ptr", "seed_lo_ptr", "seed_hi_ptr", "step_ptr", "tok_ptr",
    "generated_ptr", "max_new_ptr", "state_tok_ptr", "positions_ptr", "out_tok_ptr",
    "first_ptr", "cpos_ptr", "shift_ptr",
}  # fmt: skip
FP32_POINTERS = {
    "part_o_ptr", "part_lse_ptr", "part_m_ptr", "part_s_ptr", "part_f_ptr", "threshold_ptr",
    "logprob_ptr", "out_lp_ptr", "lse_ptr", "entropy_ptr", "g_logprob_ptr", "g_entropy_ptr",
    "pm_ptr", "pl_ptr", "pacc_ptr",
}  # fmt: skip
FLOAT_SCALARS = {"eps", "scale_log2", "inv_temperature", "log_min_p"}


def argument_types(fn, constexprs: dict, activation: str, overrides: dict) -> dict:
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in overrides:
            types[name] = overrides[name]
        elif name.endswith("_ptr"):
            if name in INT64_POINTERS:
                types[name] = "*i64"
            elif name in FP32_POINTERS:
                types[name] = "*fp32"
            elif name in ("finished_ptr", "stop_mask_ptr"):
                types[name] = "*i1"
            elif name == "table_ptr":  # a paged cache's block table
                types[name] = "*i32"
            else:
                types[name] = "*" + activation
        else:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return types


def compile_kernel(fn, constexprs: dict, activation="bf16", overrides=None, warps=4, stages=3,
             divisible: tuple[str, ...] = ()):  # fmt: skip
    """divisible: integer arguments marked divisible by 16, as the launcher marks strides and
    sizes that are (without it the pipeliner may drop to plain loads)."""
    names = fn.arg_names
    # constexpr parameters left out take their defaults (as at a launch), not a runtime i32
    defaults = {
        p.name: p.default
        for p in fn.params
        if p.is_constexpr and p.default is not inspect.Parameter.empty
    }
    constexprs = {**defaults, **constexprs}
    signature = argument_types(fn, constexprs, activation, overrides or {})
    # pointers 16-byte aligned, as torch allocations are (Triton specialises on it)
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n, t in signature.items()
        if t.startswith("*") or n in divisible
    }
    # FP fusion said explicitly: on, as launches get it by Triton's default (unset, Triton
    # 3.9 warns that the default will change)
    options = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True}
    by_index = {(names.index(k),): v for k, v in constexprs.items()}
    if not POOL:
        POOL.append(compile_pool())
    future = POOL[0].submit(compile_to_ptx, fn.__module__, fn.__name__, signature, by_index,
                            attrs, options)  # fmt: skip
    compiled = Compiled(future, f"{fn.__name__} {constexprs} {options}")
    PENDING.append(compiled)
    return compiled


POOL: list = []
"""The compile workers, started at the first compile, shut down when the session ends."""
PENDING: list[Compiled] = []
"""The compiles the running test asked for."""
