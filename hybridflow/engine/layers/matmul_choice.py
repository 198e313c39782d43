"""Which matmul runs each shape: DecodeMatmul times cuBLAS against gemm_nt's tiles and the
persistent kernel's (kernels/gemm_persistent.py) as CUDA-graph replays at the first call of
each shape, and keeps the fastest (pinned: choices.py). The kernels are in kernels/."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton

from hybridflow.engine.choices import PinnedChoices
from hybridflow.engine.kernels import sm_count
from hybridflow.engine.kernels.gemm import (
    INTERPRETER_CONFIG,
    _row_bucket,
    gate_up_silu_cublas,
    gemm_nt,
    graph_time_us,
    tma_ready,
)
from hybridflow.engine.kernels.gemm_persistent import gemm_persistent
from hybridflow.engine.kernels.launch import PLAIN, Launch

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried for gate/up + SiLU; the first won
# at 0.5b / 256 rows on the H200.
PAIR_CONFIGS = [
    (64, 128, 64, 4, 3),
    (128, 64, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (64, 64, 64, 4, 4),
    (128, 256, 64, 8, 3),  # prefill sizes
    (128, 256, 64, 8, 4),
]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M) of the persistent kernel, each
# timed at PERSISTENT_PER_SM programs per SM, for row buckets of at least PERSISTENT_MIN_ROWS
# (below that a grid of one program per tile is a single wave anyway).
PERSISTENT_CONFIGS = [
    (128, 128, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 4, 8),
]
PERSISTENT_PER_SM = (1, 2)
PERSISTENT_MIN_ROWS = 1024


class DecodeMatmul:
    """The decode layer's matmuls. `linear` is cuBLAS (gemm_nt's tiles for qkv, o_proj and
    down at 256, 1024 and 16384 rows on 0.5b and 1.5b lost every shape on the H200, e.g.
    prefill down 194 vs 241 us, 1.5b decode down 19 vs 40 us). `gate_up_silu`
    (the MLP's gate/up projection with SiLU*up, weight rows interleaved gate/up) chooses per
    shape between cuBLAS + silu_mul, gemm_nt's SiLU epilogue and (from PERSISTENT_MIN_ROWS
    rows, operands TMA can read, `persistent`) the persistent kernel's.

    mode: "auto" (time cuBLAS, each PAIR_CONFIGS tile and each persistent candidate as graph
    replays at the first call of each (row bucket, N, K), keep the fastest), "cublas" (never
    Triton), "triton" (the fastest Triton tile, never cuBLAS). Prefill passes (up to Engine.max_prefill_tokens rows)
    are timed like decode shapes; rows above max_rows always go to cuBLAS.
    The choice is made outside CUDA-graph capture (the graph warm-up runs each step first);
    a shape first met during capture uses cuBLAS. Timing reads several weight copies (~100
    MB in all) so the weight is not in L2, as in a real step. Under TRITON_INTERPRET (CPU
    tests) the Triton path runs with a small fixed tile."""

    def __init__(self, mode: str = "auto", max_rows: int = 32768, *, persistent: bool = True,
                 pinned: PinnedChoices | None = None):  # fmt: skip
        if mode not in ("auto", "cublas", "triton"):
            raise ValueError(f"decode matmul mode {mode!r} not in auto/cublas/triton")
        self.mode = mode
        self.max_rows = max_rows
        self.persistent = persistent
        self.pinned = pinned if pinned is not None else PinnedChoices()
        self.choices: dict[tuple, tuple | None] = {}  # None = cuBLAS
        self.timings: dict[tuple, dict] = {}  # key -> {candidate: us}, for reports

    def linear(self, x, weight, bias=None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def gate_up_silu(self, x: torch.Tensor, weight_pairs: torch.Tensor,
                     launch: Launch = PLAIN) -> torch.Tensor:  # fmt: skip
        """silu(gate) * up [M, I] of x [M, K] and the interleaved gate/up weight [2I, K];
        launch: how this layer launches (PDL, TMA), also while the candidates are timed."""
        rows, depth = x.shape
        if self.mode == "cublas" or rows > self.max_rows:
            return gate_up_silu_cublas(x, weight_pairs, launch)
        if not x.is_cuda:
            if depth % INTERPRETER_CONFIG[2]:
                return gate_up_silu_cublas(x, weight_pairs, launch)
            return gemm_nt(x, weight_pairs, config=INTERPRETER_CONFIG, silu_pairs=True,
                           launch=launch)  # fmt: skip
        key = (_row_bucket(rows), weight_pairs.shape[0], depth, str(x.dtype))
        if key not in self.choices:
            pinned = self.pinned.get("gate_up", key, "missing")
            if pinned != "missing" and self._known(pinned):
                self.choices[key] = pinned
            elif torch.cuda.is_current_stream_capturing():
                return gate_up_silu_cublas(x, weight_pairs, launch)
            else:
                self.choices[key] = self._choose(key, x, weight_pairs, launch)
                self.pinned.put("gate_up", key, self.choices[key])
        return self._run(self.choices[key], x, weight_pairs, launch)

    def _known(self, choice) -> bool:
        """A pinned choice is still a candidate (the tile tables may have changed since)."""
        if choice is None:
            return self.mode == "auto"
        if choice[0] == "persistent":
            return self.persistent and tuple(choice[1]) in PERSISTENT_CONFIGS
        return tuple(choice) in PAIR_CONFIGS

    @staticmethod
    def _run(choice, x, weight_pairs, launch: Launch) -> torch.Tensor:
        """One candidate: None (cuBLAS + silu_mul), a gemm_nt tile, or ("persistent", tile,
        programs per SM)."""
        if choice is None:
            return gate_up_silu_cublas(x, weight_pairs, launch)
        if choice[0] == "persistent":
            _, config, per_sm = choice
            if not tma_ready(x, weight_pairs, launch.tma):
                # chosen on aligned operands; these rows are not (a strided view): the
                # kernel needs descriptors, cuBLAS does not
                return gate_up_silu_cublas(x, weight_pairs, launch)
            return gemm_persistent(x, weight_pairs, config=config, silu_pairs=True,
                                   programs=sm_count(x.device) * per_sm)  # fmt: skip
        return gemm_nt(x, weight_pairs, config=choice, silu_pairs=True, launch=launch)

    def _choose(self, key, x, weight_pairs, launch: Launch) -> tuple | None:
        bucket, cols, depth = key[:3]
        tma = tma_ready(x, weight_pairs, launch.tma)
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

        candidates: list = [None] if self.mode == "auto" else []
        candidates += [c for c in PAIR_CONFIGS if not depth % c[2] and c[0] <= max(64, bucket)]
        if self.persistent and tma and bucket >= PERSISTENT_MIN_ROWS:
            candidates += [("persistent", c, per_sm) for c in PERSISTENT_CONFIGS
                           for per_sm in PERSISTENT_PER_SM]  # fmt: skip
        times: dict = {}
        for choice in candidates:
            try:
                times[choice] = graph_time_us(
                    cycled(lambda w, c=choice: self._run(c, x, w, launch)), calls=len(copies) * 2
                )
            except triton.runtime.errors.OutOfResources:  # fp32 tiles can exceed shared memory
                continue
        copies.clear()  # free the timing copies
        self.timings[key[:3]] = {
            "cublas" if k is None else str(k): round(v, 2) for k, v in times.items()
        }
        return min(times, key=times.get) if times else None
