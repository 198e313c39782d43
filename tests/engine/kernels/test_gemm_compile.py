"""The matmul kernels (kernels/gemm.py, gemm_persistent.py, the chain's variants) and the
log-prob heads' (models/heads/) compile for sm_90: how and why in test_kernel_compile.py."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces compiled kernels", allow_module_level=True)

from sm90_compile import compile_kernel  # noqa: E402

from hybridflow.engine.kernels import gemm, gemm_persistent  # noqa: E402
from hybridflow.engine.layers import chain as chain_mod  # noqa: E402
from hybridflow.engine.layers import matmul_choice  # noqa: E402
from hybridflow.models.heads import fused_head_kernels, logprob_kernels  # noqa: E402

GEMM_CONFIGS = [gemm.INTERPRETER_CONFIG, *matmul_choice.PAIR_CONFIGS]


@pytest.mark.parametrize("config", GEMM_CONFIGS)
def test_gemm_nt_compiles(config):
    """Every tile with the SiLU-pairs epilogue (the tiles' use: gate_up) and the split-K
    partial sums (fp32 stores); the plain bias epilogue, a subset of the pairs' code, at the
    first two tiles only (each compile takes seconds)."""
    block_m, block_n, block_k, warps, stages = config
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    chain = dict(ROW_RSTD=False, N_SS_PAD=1, RESIDUAL=False, SERIAL=False)
    fp32 = {"ws_ptr": "*fp32", "count_ptr": "*i32"}
    variants = [(False, True, False), (False, False, True)]  # (bias, pairs, partial)
    if config in GEMM_CONFIGS[:2]:
        variants.append((True, False, False))
    compiled = [
        compile_kernel(
            gemm._gemm_nt_kernel,
            dict(
                HAS_BIAS=bias,
                SILU_PAIRS=pairs,
                PARTIAL=partial,
                FP32=False,
                **chain,
                **tiles,
            ),  # fmt: skip
            overrides={"c_ptr": "*fp32" if partial else "*bf16", **fp32},
            warps=warps,
            stages=stages,
        )
        for bias, pairs, partial in variants
    ]
    for kernel in compiled:
        assert "atom" not in kernel.asm["ptx"]  # only SERIAL split-K counts programs


@pytest.mark.parametrize("config", matmul_choice.PERSISTENT_CONFIGS)
def test_persistent_gemms_compile_to_tma_and_wgmma(config):
    """Each persistent tile compiles for sm_90 with TMA loads and wgmma (a loop the pipeliner
    could not handle would fall back to plain loads and mma.sync), and no atomics."""
    block_m, block_n, block_k, warps, stages, group_m = config
    compiled = compile_kernel(
        gemm_persistent._persistent_nt_kernel,
        dict(HAS_BIAS=False, SILU_PAIRS=True, FP32=False, BLOCK_M=block_m, BLOCK_N=block_n,
             BLOCK_K=block_k, GROUP_M=group_m),
        overrides={"a_desc": f"tensordesc<bf16[{block_m}, {block_k}]>",
                   "w_desc": f"tensordesc<bf16[{block_n}, {block_k}]>"},
        warps=warps, stages=stages,
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert "atom" not in ptx


@pytest.mark.parametrize("config", chain_mod.CHAIN_TILES)
def test_chain_matmuls_compile(config):
    """The five-launch layer's variants: rows scaled by 1/rms (+ SiLU pairs, + bias), residual
    epilogue with and without the in-kernel split-K reduction. All four at the first tile;
    at the others the two whose epilogues hold every other's code (1/rms with SiLU pairs'
    reshape; residual with the split-K reduction): the main loop is the same in all four,
    and each compile takes seconds."""
    block_m, block_n, block_k, warps, stages = config
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    plain = dict(PARTIAL=False, FP32=False)
    fp32 = {"ss_in_ptr": "*fp32", "ss_out_ptr": "*fp32", "ws_ptr": "*fp32", "count_ptr": "*i32",
            "eps": "fp32"}  # fmt: skip
    variants = [
        dict(HAS_BIAS=True, SILU_PAIRS=False, ROW_RSTD=True, N_SS_PAD=16, RESIDUAL=False,
             SERIAL=False),
        dict(HAS_BIAS=False, SILU_PAIRS=True, ROW_RSTD=True, N_SS_PAD=32, RESIDUAL=False,
             SERIAL=False),
        dict(HAS_BIAS=False, SILU_PAIRS=False, ROW_RSTD=False, N_SS_PAD=1, RESIDUAL=True,
             SERIAL=False),
        dict(HAS_BIAS=True, SILU_PAIRS=False, ROW_RSTD=False, N_SS_PAD=1, RESIDUAL=True,
             SERIAL=True),
    ]  # fmt: skip
    if config != chain_mod.CHAIN_TILES[0]:
        variants = [variants[1], variants[3]]
    compiled = [
        compile_kernel(gemm._gemm_nt_kernel, dict(**flags, **plain, **tiles), overrides=fp32,
                       warps=warps, stages=stages)
        for flags in variants
    ]  # fmt: skip
    for flags, kernel in zip(variants, compiled):
        if flags["SERIAL"]:
            assert "atom" in kernel.asm["ptx"]


@pytest.mark.parametrize("with_entropy", [True, False])
def test_logprob_kernels_compile(with_entropy):
    constexprs = dict(WITH_ENTROPY=with_entropy, BLOCK=logprob_kernels.BLOCK_V)
    compile_kernel(logprob_kernels._stats_kernel, constexprs, warps=8)
    compile_kernel(logprob_kernels._grad_kernel, constexprs, warps=8)


@pytest.mark.parametrize("with_entropy,even_k,activation",
                         [(True, True, "bf16"), (False, True, "bf16"), (True, False, "bf16"),
                          (True, True, "fp16")])  # fmt: skip
def test_fused_head_kernels_compile_to_wgmma(with_entropy, even_k, activation):
    """The fused log-prob head's tiles compile with wgmma (its matmul runs on the tensor
    cores) and no atomics (the results do not depend on program order)."""
    k = fused_head_kernels
    constexprs = dict(WITH_ENTROPY=with_entropy, BLOCK_T=k.BLOCK_T, BLOCK_V=k.BLOCK_V,
                      BLOCK_K=k.BLOCK_K, EVEN_K=even_k)  # fmt: skip
    partials = {"part_t_ptr": "*fp32", "part_target_ptr": "*fp32"}
    compiled = [
        compile_kernel(kernel, constexprs, activation, overrides, warps=k.NUM_WARPS,
                       stages=k.NUM_STAGES, divisible=("stride_h", "stride_w", "H"))
        for kernel, overrides in [(k._forward_kernel, partials), (k._grad_tile_kernel, {})]
    ]  # fmt: skip
    for kernel in compiled:
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "atom" not in ptx


@pytest.mark.parametrize("config", [(64, 128, 64, 4, 3), (64, 64, 128, 4, 4)])
def test_gemm_nt_tma_variant_loads_tiles_with_bulk_tensor_copies(config):
    """Launch.tma: a and w tiles through tensor descriptors; the PTX must use the TMA engine
    (cp.async.bulk.tensor), with the chain's epilogues too."""
    block_m, block_n, block_k, warps, stages = config
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    descriptors = {
        "a_desc": f"tensordesc<bf16[{block_m}, {block_k}]>",
        "w_desc": f"tensordesc<bf16[{block_n}, {block_k}]>",
        "ss_in_ptr": "*fp32", "ss_out_ptr": "*fp32", "ws_ptr": "*fp32", "count_ptr": "*i32",
        "eps": "fp32",
    }  # fmt: skip
    compiled = [
        compile_kernel(
            gemm._gemm_nt_kernel,
            dict(HAS_BIAS=False, PARTIAL=False, FP32=False, TMA=True, **flags, **tiles),
            overrides=descriptors, warps=warps, stages=stages,
        )
        for flags in [
            dict(SILU_PAIRS=True, ROW_RSTD=True, N_SS_PAD=32, RESIDUAL=False, SERIAL=False),
            dict(SILU_PAIRS=False, ROW_RSTD=False, N_SS_PAD=1, RESIDUAL=True, SERIAL=True),
        ]
    ]  # fmt: skip
    for kernel in compiled:
        assert "cp.async.bulk.tensor" in kernel.asm["ptx"]
