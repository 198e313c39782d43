"""The mixture-of-experts kernels (kernels/experts/moe.py, biased_grouped.py, grouped_route.py,
latent_rope.py) compile for sm_90: how and why in test_kernel_compile.py."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces compiled kernels", allow_module_level=True)

from sm90_compile import compile_kernel  # noqa: E402

from hybridflow.engine.kernels import latent_rope  # noqa: E402
from hybridflow.engine.kernels.experts import (  # noqa: E402
    biased_grouped,
    grouped_route,
    moe,
    routing,
)


@pytest.mark.parametrize("block_m", [16, 128])  # decode's smallest block, prefill's
def test_moe_kernels_compile(block_m):
    """Routing (with its record), the sort by expert, both grouped matmuls at each block's
    tile (tensor-core dots, no atomics: the order is fixed) and the combine."""
    ints = {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
            "total_ptr": "*i32", "ends_ptr": "*i32", "counts_ptr": "*i32"}  # fmt: skip
    route_types = {**ints, "weights_ptr": "*fp32", "logits_ptr": "*bf16", "routes_ptr": "*u8",
                   "entry_ptr": "*i64", "offset_ptr": "*i64"}  # fmt: skip
    compile_kernel(routing._topk_kernel, dict(TOP_K=8, K_PAD=8, E_PAD=128, BLOCK_T=16,
                                              RENORM=True, RECORD=True),
                   overrides=route_types)  # fmt: skip
    # the sort by expert: the counts, then the placement (decode: 2048 pairs, 128 experts)
    compile_kernel(moe._count_kernel, dict(CHUNK=2048), overrides=ints, warps=8)
    compile_kernel(moe._align_kernel, dict(BINS=128, BLOCK_M=block_m, CHUNK=2048), overrides=ints,
                   warps=8)  # fmt: skip
    grouped = []
    for silu in (True, False):
        block_n, block_k, warps, stages = moe.TILES[block_m]["gate_up" if silu else "down"]
        grouped.append(compile_kernel(
            moe._grouped_kernel,
            dict(TOP_K=8, GATHER=silu, SILU_UP=silu, FP32=False, BLOCK_M=block_m,
                 BLOCK_N=block_n, BLOCK_K=block_k),
            overrides=ints, warps=warps, stages=stages,
            divisible=("P", "N", "K", "stride_am", "stride_we", "stride_wn", "stride_cm", "up_rows"),
        ))  # fmt: skip
    compile_kernel(moe._combine_kernel, dict(TOP_K=8, BLOCK_H=2048), overrides={"w_ptr": "*fp32"})
    for compiled in grouped:
        ptx = compiled.asm["ptx"]  # pipelined (async copies), tensor cores, no atomics
        assert "cp.async" in ptx and "mma" in ptx and "atom" not in ptx


@pytest.mark.parametrize("block_m", [16, 32, 128])  # decode's blocks (up to 256 rows), prefill's
def test_fp8_expert_kernels_compile(block_m):
    """The fp8 rollout's experts (fp8/experts.py): both grouped matmuls over e4m3 weights
    with fp32 row scales at each block's tile, each tile widened to bf16 in the loop: still
    pipelined tensor-core dots, the widening by the hardware's e4m3 converts, no atomics."""
    ints = {"sorted_ptr": "*i32", "block_expert_ptr": "*i32", "total_ptr": "*i32"}
    for silu in (True, False):
        block_n, block_k, warps, stages = moe.TILES[block_m]["gate_up" if silu else "down"]
        compiled = compile_kernel(
            moe._grouped_kernel,
            dict(TOP_K=8, GATHER=silu, SILU_UP=silu, FP32=False, BLOCK_M=block_m,
                 BLOCK_N=block_n, BLOCK_K=block_k, W_FP8=True),
            overrides={**ints, "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, warps=warps,
            stages=stages,
            divisible=("P", "N", "K", "stride_am", "stride_we", "stride_wn", "stride_cm",
                       "up_rows", "stride_se"),
        )  # fmt: skip
        ptx = compiled.asm["ptx"]
        assert "cp.async" in ptx and "mma" in ptx and "atom" not in ptx
        assert "cvt.rn.f16x2.e4m3x2" in ptx  # e4m3 pairs widened in registers


@pytest.mark.parametrize("block_m", [16, 32])  # decode's blocks at 256 rows: 8 and 64 experts
def test_moe_family_decode_kernels_compile(block_m):
    """The MoE families' decode pieces on the Triton step: GPT-OSS's grouped expert kernels
    over [E, in, out] weights (the bias and clamped SwiGLU in the gate/up epilogue) at each
    block's tile, DeepSeek-V3's grouped routing with its record (8 groups of 32, top 4
    groups), MLA's one-launch ropes, latent norm and store (Moonlight's 16 heads, V3's 128)."""
    ints = {"sorted_ptr": "*i32", "block_expert_ptr": "*i32", "total_ptr": "*i32"}
    grouped = []
    for gate_up in (True, False):
        block_n, block_k, warps, stages = moe.TILES[block_m]["gate_up" if gate_up else "down"]
        grouped.append(compile_kernel(
            biased_grouped._grouped_in_out_kernel,
            dict(TOP_K=4, GATE_UP=gate_up, FP32=False, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=block_k),
            overrides={**ints, "alpha": "fp32", "limit": "fp32"}, warps=warps, stages=stages,
            divisible=("N", "K", "stride_am", "stride_we", "stride_wk", "stride_cm",
                       "stride_be"),
        ))  # fmt: skip
    route_types = {"logits_ptr": "*fp32", "correction_ptr": "*fp32", "ids_ptr": "*i32",
                   "weights_ptr": "*fp32", "routes_ptr": "*u8", "entry_ptr": "*i64",
                   "offset_ptr": "*i64", "scaling": "fp32"}  # fmt: skip
    for groups, chosen in ((8, 4), (1, 1)):
        compile_kernel(grouped_route._grouped_route_kernel,
                       dict(TOP_K=8, K_PAD=8, E_PAD=256, N_GROUP=groups, G_PAD=max(groups, 2),
                            TOPK_GROUP=chosen, GROUP_SIZE=256 // groups, BLOCK_T=16, RENORM=True,
                            RECORD=True), overrides=route_types)  # fmt: skip
    rope = {"entry_ptr": "*i64", "offset_ptr": "*i64"}
    for heads in (16, 128):
        compile_kernel(latent_rope._latent_rope_store_kernel,
                       dict(NOPE=128, HALF=32, HALF_PAD=32, RANK=512, RANK_PAD=512,
                            HEADS_PAD=heads, INTERLEAVED=True), overrides=rope)  # fmt: skip
    for compiled in grouped:
        ptx = compiled.asm["ptx"]  # tensor cores, no atomics
        assert "mma" in ptx and "atom" not in ptx
