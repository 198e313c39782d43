"""Which backend an Engine decodes with, and the Triton pieces the triton backend runs.

resolve_backend picks torch or triton from EngineOptions.decode_backend and the device;
triton_pieces makes the launch settings, the decode matmul, chain and layer chooser (kept
across release(): their shape choices); check_fp8_kv says what an FP8 KV cache does not cover.
"""

from __future__ import annotations

import os

import torch


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(requested: str, device: torch.device) -> str:
    """The backend (torch or triton) for EngineOptions.decode_backend ``requested``. A
    tensor-parallel shard runs the split layer on the triton backend (its all-reduces where
    the eager path has them: layers/split.py), a mixture of experts included (experts_triton
    sums a rank's share of the experts as the eager path does); so do experts spread over
    replicas (experts_triton dispatches and combines by all-to-all, engine/expert_spread.py)."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # kernel tests on CPU
    if requested == "triton" and device.type != "cuda" and not interpreted:
        raise ValueError("decode_backend='triton' needs the model on a CUDA device")
    return requested


def triton_pieces(options, device: torch.device, pinned, split: bool):
    """(launch settings, DecodeMatmul, DecodeChain, DecodeLayerChooser) of the triton
    backend, with the pinned choices; split: the split decode layer whatever
    options.decode_layer says (fp8 projections, LoRA adapters, experts, a tensor-parallel
    shard)."""
    from hybridflow.engine.choices import pin_attention_tiles
    from hybridflow.engine.kernels.launch import launch_for
    from hybridflow.engine.layers.chain import DecodeChain
    from hybridflow.engine.layers.chooser import DecodeLayerChooser
    from hybridflow.engine.layers.matmul_choice import DecodeMatmul

    launch = launch_for(device, options.pdl, options.prefetch_weights, options.tma)
    matmul = DecodeMatmul(options.decode_matmul, persistent=options.persistent_matmul,
                          pinned=pinned)  # fmt: skip
    chain = DecodeChain(launch=launch, pinned=pinned)
    chooser = DecodeLayerChooser("split" if split else options.decode_layer, pinned=pinned)
    pin_attention_tiles(pinned)
    return launch, matmul, chain, chooser


def check_fp8_kv(engine) -> None:
    """ValueError naming what an FP8 KV cache does not cover in this engine."""
    from hybridflow.engine.cache.fp8_kv import fp8_kv_device_problem, fp8_kv_problem

    problem = None
    if not engine.native:
        problem = ("kv_cache_dtype='fp8': this model runs on the engine's slow path, "
                   "which keeps no cache of its own")  # fmt: skip
    elif engine.tensor_parallel > 1:
        problem = "kv_cache_dtype='fp8' does not cover a tensor-parallel engine yet"
    else:
        block_size = engine.options.kv_block_size
        problem = fp8_kv_problem(engine.config.layer_specs(), block_size is not None)
    if problem is None and engine.device.type == "cuda":
        capability = torch.cuda.get_device_capability(engine.device)
        problem = fp8_kv_device_problem(engine.decode_backend, capability)
    if problem is not None:
        raise ValueError(f"{problem}: set rollout.engine.kv_cache_dtype=model")
