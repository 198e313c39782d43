"""The engine's Triton kernels (CUDA; run on the CPU under TRITON_INTERPRET=1 in tests):
row-wise fusions (RMSNorm, SiLU*up, RoPE + cache store), decode attention, the shared-prefix
attention, decode matmuls, the fused sampler, and the launch options they share (pdl.py).

Importing this package needs only torch; each module imports Triton."""

from __future__ import annotations

import functools

import torch

# SM count assumed where there is no CUDA device (the interpreter): an H200's.
INTERPRETER_SMS = 132


@functools.lru_cache(maxsize=8)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (grid sizes of the persistent and split kernels)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
