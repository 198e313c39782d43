"""Which matmul runs each shape: DecodeMatmul times cuBLAS against gemm_nt's tiles (and,
with TAIL_SPLIT, tiles whose last partial wave is split along K) as CUDA-graph replays at the
first call of each shape, and keeps the fastest. The kernels themselves are in gemm.py."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton

from hybridflow.engine.gemm import (
    INTERPRETER_CONFIG,
    _row_bucket,
    gate_up_silu_cublas,
    gemm_nt,
    graph_time_us,
    tail_plan,
    tail_scratch,
)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried for gate/up + SiLU; the first won
# at 0.5b / 256 rows on the H200 (run 5).
PAIR_CONFIGS = [
    (64, 128, 64, 4, 3),
    (128, 64, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (64, 64, 64, 4, 4),
    (128, 256, 64, 8, 3),  # prefill sizes
    (128, 256, 64, 8, 4),
]
# Also time each PAIR_CONFIGS tile with its last partial wave split along K (tail_plan), at 1,
# 2 and 3 programs per SM. Off until measured on a GPU (written in session 7 without device
# time left; interpreter and sm_90 compile tests only): where it should pay, by the wave
# arithmetic, is 1.5b's gate/up at 256 rows (560 tiles of 64 x 128 over 396 slots) and
# 0.5b's at 1024 rows (608 tiles of 128 x 128 over 264).
TAIL_SPLIT = False


class DecodeMatmul:
    """The decode layer's matmuls. `linear` is cuBLAS (session 7 timed gemm_nt's tiles for
    qkv, o_proj and down at 256, 1024 and 16384 rows on 0.5b and 1.5b: cuBLAS won every
    shape, e.g. prefill down 194 vs 241 us, 1.5b decode down 19 vs 40 us). `gate_up_silu`
    (the MLP's gate/up projection with SiLU*up, weight rows interleaved gate/up) chooses per
    shape between cuBLAS + silu_mul and gemm_nt's SiLU epilogue.

    mode: "auto" (time cuBLAS and each PAIR_CONFIGS tile as graph replays at the first call
    of each (row bucket, N, K), keep the fastest), "cublas" (never Triton), "triton" (the
    fastest Triton tile, never cuBLAS). Prefill passes (up to Engine.max_prefill_tokens rows)
    are timed like decode shapes; rows above max_rows always go to cuBLAS.
    The choice is made outside CUDA-graph capture (the graph warm-up runs each step first);
    a shape first met during capture uses cuBLAS. Timing reads several weight copies (~100
    MB in all) so the weight is not in L2, as in a real step. Under TRITON_INTERPRET (CPU
    tests) the Triton path runs with a small fixed tile."""

    def __init__(self, mode: str = "auto", max_rows: int = 32768):
        if mode not in ("auto", "cublas", "triton"):
            raise ValueError(f"decode matmul mode {mode!r} not in auto/cublas/triton")
        self.mode = mode
        self.max_rows = max_rows
        self.choices: dict[tuple, tuple | None] = {}  # None = cuBLAS
        self.timings: dict[tuple, dict] = {}  # key -> {candidate: us}, for the notes
        self._scratch: dict[tuple, tuple] = {}  # (tail config, device) -> (workspace, counts)

    def linear(self, x, weight, bias=None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def gate_up_silu(self, x: torch.Tensor, weight_pairs: torch.Tensor) -> torch.Tensor:
        rows, depth = x.shape
        if self.mode == "cublas" or rows > self.max_rows:
            return gate_up_silu_cublas(x, weight_pairs)
        if not x.is_cuda:
            if depth % INTERPRETER_CONFIG[2]:
                return gate_up_silu_cublas(x, weight_pairs)
            return gemm_nt(x, weight_pairs, config=INTERPRETER_CONFIG, silu_pairs=True)
        key = (_row_bucket(rows), weight_pairs.shape[0], depth, x.dtype, x.device.index)
        if key not in self.choices:
            if torch.cuda.is_current_stream_capturing():
                return gate_up_silu_cublas(x, weight_pairs)
            self.choices[key] = self._choose(key, x, weight_pairs)
        config = self.choices[key]
        if config is None:
            return gate_up_silu_cublas(x, weight_pairs)
        return gemm_nt(x, weight_pairs, config=config[:5], silu_pairs=True,
                       tail=self._tail(x, weight_pairs, config))  # fmt: skip

    def _tail(self, x, weight, config) -> tuple | None:
        """gemm_nt's tail argument for a config chosen with a programs-per-SM count (a 6th
        entry; TAIL_SPLIT), planned for these rows; the scratch (sized for any row count:
        split tiles x splits <= slots) is made on the first call, outside graph capture."""
        if len(config) < 6:
            return None
        slots = _sm_count(x.device) * config[5]
        plan = tail_plan(x.shape[0], weight.shape[0], x.shape[1], config, slots)
        if plan is None:
            return None
        skey = (config, x.device.index)
        if skey not in self._scratch:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("DecodeMatmul: tail scratch first needed during capture")
            self._scratch[skey] = tail_scratch((0, slots, 1), config, x.device)
        return (plan, *self._scratch[skey])

    def _choose(self, key, x, weight_pairs) -> tuple | None:
        bucket, cols, depth = key[:3]
        nbytes = weight_pairs.numel() * weight_pairs.element_size()
        copies = [weight_pairs] + [
            weight_pairs.clone() for _ in range(min(7, math.ceil(100e6 / nbytes) - 1))
        ]
        x = torch.randn(bucket, depth, dtype=x.dtype, device=x.device)

        def cycled(call):
            state = {"i": 0}

            def fn():
                state["i"] = (state["i"] + 1) % len(copies)
                return call(copies[state["i"]])

            return fn

        times: dict = {}
        if self.mode == "auto":
            times["cublas"] = graph_time_us(cycled(lambda w: gate_up_silu_cublas(x, w)),
                                            calls=len(copies) * 2)  # fmt: skip
        for config in PAIR_CONFIGS:
            if depth % config[2] or config[0] > max(64, bucket):
                continue
            try:
                times[config] = graph_time_us(
                    cycled(lambda w, c=config: gemm_nt(x, w, config=c, silu_pairs=True)),
                    calls=len(copies) * 2,
                )
            except triton.runtime.errors.OutOfResources:  # fp32 tiles can exceed shared memory
                continue
            if not TAIL_SPLIT or config not in times:
                continue
            plans = set()
            for per_sm in (1, 2, 3):  # the tile's occupancy is not known here: try each
                candidate = (*config, per_sm)
                plan = tail_plan(bucket, cols, depth, config, _sm_count(x.device) * per_sm)
                if plan is None or plan in plans:
                    continue
                plans.add(plan)
                times[candidate] = graph_time_us(
                    cycled(lambda w, c=candidate: gemm_nt(
                        x, w, config=c[:5], silu_pairs=True, tail=self._tail(x, w, c))),
                    calls=len(copies) * 2,
                )  # fmt: skip
        copies.clear()  # free the timing copies
        self.timings[key[:3]] = {str(k): round(v, 2) for k, v in times.items()}
        if not times:
            return None
        best = min(times, key=times.get)
        for candidate in list(self._scratch):  # keep the chosen tail's scratch only
            if candidate[0] != best:
                del self._scratch[candidate]
        return None if best == "cublas" else best


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
