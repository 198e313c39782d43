"""What an Engine allocates before it generates (Engine._allocate), and frees on release().

Its fused and FP8 weight copies first (a memory budget given as a fraction of free memory must
see them used), then the KV cache with the workspace reserved beside it (cache/workspace.py;
the memory plan reserves the same), the decode state, the rotary table, the forward passes of
the engine's backend and the decode runner and scheduler over them.
"""

from __future__ import annotations

import functools
import logging

import torch

from hybridflow.engine.cache import kv_cache, sizing
from hybridflow.engine.cache.workspace import engine_workspace_bytes, sampling_bytes_per_row
from hybridflow.engine.fp8.weight_scales import ENGINE_SCALES
from hybridflow.engine.graphs import DecodeRunner
from hybridflow.engine.kernels.launch import PLAIN
from hybridflow.engine.prefill import RopeTable, extend_forward, prefill_forward
from hybridflow.engine.scheduling.scheduler import Scheduler
from hybridflow.engine.state import DecodeState
from hybridflow.engine.weights.fused import FusedProjections

log = logging.getLogger("hybridflow.engine")


def allocate(engine) -> None:
    """The engine's cache, decode state, rotary table, forward passes, runner and scheduler
    (its attributes of those names), its fused and FP8 weight copies made first."""
    cfg = engine.config
    engine.kept.clear()  # a new cache holds nothing
    engine.fused, engine.fp8 = _weight_copies(engine)
    engine.cache, engine.blocks = _make_cache(engine)
    slots = engine.cache.num_slots
    report_capped_slots(engine, slots)
    engine.state = DecodeState(slots, slots, engine.max_seq_len, cfg.vocab_size, engine.device)
    engine.rope = RopeTable(cfg, engine.max_seq_len, engine.dtype, engine.device,
                            slots if engine.vision else None)  # fmt: skip
    decode_forward, engine.prefill, engine.extend = _forward_passes(engine)
    engine.runner = DecodeRunner(
        engine.model, engine.cache, engine.state, engine.rope, decode_forward,
        use_graphs=engine.cuda_graphs,
        use_triton_sampler="triton" in (engine.decode_backend, engine.recurrent_step),
        launch=engine.launch or PLAIN,
    )  # fmt: skip
    engine.scheduler = Scheduler(engine)
    engine.scheduler.version = engine.policy_version


def report_capped_slots(engine, slots: int) -> None:
    """One log line, at the first allocation, when a paged cache's per-sequence kinds got
    fewer slots than max_batch_size (EngineOptions.cap_state_slots)."""
    cache = engine.cache
    capped = cache.paged and cache.per_sequence and slots < engine.max_batch_size
    if not capped or engine._capped_reported:
        return
    engine._capped_reported = True
    log.warning("engine: %d slots of max_batch_size=%d: the memory budget holds the "
                "per-sequence state and K/V blocks of %d whole sequences of max_seq_len=%d "
                "(rollout.engine.cap_state_slots=false keeps them all)", slots,
                engine.max_batch_size, slots, engine.max_seq_len)  # fmt: skip


def _weight_copies(engine):
    """(fused projections or None, fp8.Fp8Matmul or None): made before the cache, so that a
    budget given as a fraction of free memory sees them used."""
    fused = fp8 = None
    if engine.decode_backend == "triton" and engine.fuse_projections != "none":
        fused = FusedProjections(engine.model, gate_up=engine.fuse_projections == "all",
                                 fold=engine.fp8_weight_scales == ENGINE_SCALES)  # fmt: skip
    if engine.options.weight_format == "fp8":
        from hybridflow.engine.fp8.linears import eager_linears
        from hybridflow.engine.fp8.matmul import Fp8Matmul

        # the eager passes' projections (fp8/linears.py), or the fused layers' own
        linears = eager_linears(engine.model) if engine.eager_layers else None
        fp8 = Fp8Matmul(engine.model, fused, weight_scales=engine.fp8_weight_scales,
                        linears=linears)  # fmt: skip
    return fused, fp8


def _make_cache(engine):
    """(KVCache, BlockPool or None) in the memory budget, less the workspace of decode
    sampling and prefill activations, which live outside the cache."""
    cfg, options = engine.config, engine.options
    element = torch.empty((), dtype=engine.dtype).element_size()
    reserve = engine_workspace_bytes(cfg, engine.max_batch_size, engine.max_prefill_tokens,
                                     element, engine.tensor_parallel)  # fmt: skip
    draft = engine.speculation.draft_model if engine.speculation is not None else None
    if draft is not None:  # its cache, made at the first tail (speculative/draft_model.py)
        rows = min(options.speculative_max_rows, engine.max_batch_size)
        reserve += draft.cache_bytes(rows, engine.max_seq_len)
    routes = None
    if engine.moe:
        routes = kv_cache.route_spec(cfg) if options.record_routes else None
    return sizing.make_cache(
        cfg, engine.max_batch_size, engine.max_seq_len, options.kv_block_size,
        engine.memory_budget, reserve, engine.dtype, engine.device, routes,
        options.cap_state_slots, sampling_bytes_per_row(cfg, engine.tensor_parallel),
        kv_fp8=engine.kv_fp8,
    )  # fmt: skip


def _forward_passes(engine):
    """(decode step, prefill, extend) for the engine's backend over its new cache; the torch
    backend keeps the engine's extend pass unless MLA's absorbed attention needs a kernel."""
    if engine.decode_backend == "triton":
        return _triton_passes(engine)
    from hybridflow.engine.layers.eager import decode_forward_torch

    # the engine's extend pass as it was before an fp8 wrapper of an earlier cache
    extend = getattr(engine.extend, "eager_pass", engine.extend)
    decode_forward, prefill = decode_forward_torch, prefill_forward
    step = engine.recurrent_step
    if engine.eager_layers:  # recurrent steps, attention and norms on the asked backend
        decode_forward = functools.partial(decode_forward_torch, recurrent_step=step,
                                           attention_step=step, norm_step=step,
                                           expert_step=step)  # fmt: skip
        prefill = functools.partial(prefill_forward, attention_step=step, expert_step=step)
    if engine.cache.latent is not None:  # MLA: the absorbed attention's kernel likewise
        decode_forward = functools.partial(decode_forward, latent_step=step)
        extend = functools.partial(extend_forward, latent_step=step)
    if engine.fp8 is not None:  # the fp8 rollout of the eager layers (fp8/linears.py)
        return _fp8_eager_passes(engine.fp8, (decode_forward, prefill, extend))
    return decode_forward, prefill, extend


def _fp8_eager_passes(fp8, passes):
    """The eager passes (decode step, prefill, extend) over the fp8 copies: each runs with
    the projections fp8 (fp8/linears.with_fp8_projections) and the routed experts' e4m3
    copies (fp8/experts.py)."""
    from hybridflow.engine.fp8.linears import with_fp8_projections

    wrapped = []
    for run in passes:
        fp8_run = with_fp8_projections(fp8, fp8.linears,
                                       functools.partial(run, fp8_experts=fp8.experts))  # fmt: skip
        fp8_run.eager_pass = run  # what the next cache's passes start from
        wrapped.append(fp8_run)
    return tuple(wrapped)


def _triton_passes(engine):
    """(decode step, prefill, extend) of the triton backend, over the fused copies and the
    engine's matmul (its FP8 one, or through LoRA adapters)."""
    from hybridflow.engine.adapters import AdapterMatmul
    from hybridflow.engine.layers.chooser import decode_forward_triton
    from hybridflow.engine.layers.matmul_choice import DecodeMatmul
    from hybridflow.engine.prefill import extend_forward_triton, prefill_forward_triton

    matmul = engine.fp8 if engine.fp8 is not None else engine.matmul
    extend_matmul = engine.fp8 if engine.fp8 is not None else DecodeMatmul("cublas")
    if engine.adapted:
        matmul = AdapterMatmul(engine.model, matmul)
        extend_matmul = AdapterMatmul(engine.model, extend_matmul)
    decode_forward = functools.partial(
        decode_forward_triton, fused=engine.fused, matmul=matmul, chain=engine.chain,
        chooser=engine.chooser, launch=engine.launch,
        autotune=engine.options.attention_autotune, experts=engine.experts,
    )  # fmt: skip
    prefill = functools.partial(prefill_forward_triton, fused=engine.fused, matmul=matmul,
                                launch=engine.launch, experts=engine.experts)  # fmt: skip
    # (a pass with images gives both passes its embeddings and mRoPE cos/sin: images.py)
    # Extend passes (kept-KV turns) come in whatever token counts the requests arrive with:
    # timing candidates at each new count would stall the engine (an H200 agent benchmark
    # spent 3.7 of its 4.3 s in 14 such passes), so they run cuBLAS and the untuned
    # attention tile.
    extend = functools.partial(extend_forward_triton, fused=engine.fused, matmul=extend_matmul,
                               launch=engine.launch, autotune=False,
                               experts=engine.experts)  # fmt: skip
    return decode_forward, prefill, extend
