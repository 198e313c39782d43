"""Every Triton kernel compiles for an H100/H200 (sm_90) target, on a machine without a GPU.

Why: the interpreter (TRITON_INTERPRET=1, the CPU kernel tests) runs kernels as numpy and
does not type-check them; a loop-carried variable that changes shape or a tl.dot with K < 16
only fails in the real compiler (one device call died that way). `triton.compile` with a
GPUTarget runs the whole pipeline down to the cubin with the bundled ptxas, no GPU needed.
Skipped without triton (the main CI run) and under the interpreter. The compiles run in a
pool of worker processes (tests/sm90_compile.py): each test submits its kernels, then reads
their PTX; one a test does not read still fails it, at its teardown (conftest.py). Here: the
sampler, the FP8 quantizers, the Gated DeltaNet step and the PDL variants; beside it, the
attention, MoE and matmul kernels (test_attention_compile.py, test_moe_compile.py,
test_gemm_compile.py)."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces compiled kernels", allow_module_level=True)

from sm90_compile import compile_kernel  # noqa: E402

from hybridflow.engine.kernels import (  # noqa: E402
    attention_kernel,
    delta_step,
    delta_step_grouped,
    fp8_quant,
    gemm,
    rowwise,
    sampler,
    shared_prefix,
)

# the Gated DeltaNet step's pointers and scalars beside the bf16 activations
DELTA_TYPES = {"ssm_ptr": "*fp32", "qk_ptr": "*fp32", "core_ptr": "*fp32", "g_ptr": "*fp32",
               "read_ptr": "*i64", "write_ptr": "*i64", "scale": "fp32", "norm_eps": "fp32"}  # fmt: skip


@pytest.mark.parametrize("block_v,warps", [(128, 8), (128, 4), (64, 4), (32, 2)])
def test_delta_step_kernels_compile(block_v, warps):
    """kernels/delta_step.py at Qwen3.5-4B's shape (16 key heads, 32 value heads of 128 x
    128, a 4-tap conv), corners of benchmarks/delta_step.py's sweep: a state tile of the
    whole head (the gated norm fused, bf16 out) or narrower ones (fp32 core, then the norm
    kernel); with the q/k kernel and the former grouped kernel the benchmark times."""
    shape = dict(DK=128, DV=128, GROUP=2, KERNEL=4, BLOCK_K=128, BLOCK_V=block_v)
    fused = block_v == 128
    out = {"out_ptr": "*bf16" if fused else "*fp32"}
    compile_kernel(delta_step._state_kernel, {**shape, "NORM": fused},
                   overrides={**DELTA_TYPES, **out}, warps=warps)  # fmt: skip
    if block_v == 32:
        compile_kernel(delta_step._qk_kernel, dict(DK=128, KERNEL=4, BLOCK_K=128),
                       overrides=DELTA_TYPES)  # fmt: skip
        compile_kernel(delta_step._norm_kernel, dict(DV=128, BLOCK_V=128), overrides=DELTA_TYPES)
        compile_kernel(delta_step_grouped._delta_step_kernel, shape,
                       overrides={**DELTA_TYPES, "out_ptr": "*fp32"})  # fmt: skip


@pytest.mark.parametrize(
    "greedy,filtered",
    [(True, False), (False, False), (False, True)],
    ids=["greedy", "T", "filters"],
)
def test_sampler_kernels_compile(greedy, filtered):
    common = dict(
        GREEDY=greedy, SCALE=filtered, HAS_THRESHOLD=filtered, HAS_MIN_P=filtered,
        SPLITS=38, SPLITS_PAD=64, SPLIT_SIZE=4096, BLOCK_V=4096,
    )  # fmt: skip
    part_idx = {"part_idx_ptr": "*i32"}
    for max_only in [True, False] if filtered else [False]:
        compile_kernel(
            sampler._split_stats_kernel,
            dict(common, MAX_ONLY=max_only),
            overrides=part_idx,
            warps=8,
        )
    for advance in (True, False):
        compile_kernel(
            sampler._sample_combine_kernel,
            dict(common, ADVANCE=advance),
            overrides=part_idx,
            warps=8,
        )


@pytest.mark.parametrize("pdl", [False, True])
def test_e4m3_writers_compile_with_the_hardware_cast(pdl):
    """The kernels that quantize activations for fp8 matmuls (fp8.py): the standalone one, the
    norms' E4M3 variant, SiLU*up's. Their e4m3 values are rounded in fp32 first, so the store's
    cast (cvt...e4m3x2) only has exact values to convert."""
    e4m3 = {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "tiny": "fp32"}
    on = dict(PDL=True) if pdl else {}
    compiled = [
        compile_kernel(fp8_quant._quantize_rows_kernel, dict(BLOCK_K=2048), overrides=e4m3, warps=8)
    ]
    for add, weighted in [(True, True), (False, True), (True, False)]:
        norm = dict(ADD=add, WEIGHT=weighted, BLOCK_H=2048, E4M3=True, **on)
        compiled.append(compile_kernel(rowwise._rms_norm_kernel, norm, overrides=e4m3))
    for pairs in (True, False):
        silu = dict(PAIRS=pairs, BLOCK=rowwise.SILU_E4M3_BLOCK, **on)
        compiled.append(
            compile_kernel(rowwise._silu_mul_e4m3_kernel, silu, overrides=e4m3, warps=8)
        )
    for kernel in compiled:
        assert "e4m3x2" in kernel.asm["ptx"]
    if pdl:  # the standalone quantizer takes no PDL launch
        assert all("griddepcontrol.wait" in kernel.asm["ptx"] for kernel in compiled[1:])


def test_pdl_variants_compile_with_grid_dependency_control():
    """With PDL every kernel waits on the previous one (griddepcontrol.wait) and lets the next
    launch; the matmul and the shared-prefix kernel also prefetch into L2 before the wait
    (pdl.py)."""
    on = dict(PDL=True)
    compiled = [
        compile_kernel(
            rowwise._rms_norm_kernel, dict(ADD=True, WEIGHT=True, BLOCK_H=1024, **on)
        ),  # fmt: skip
        compile_kernel(
            attention_kernel._decode_attention_kernel,
            dict(
                G=7, G_PAD=16, HALF=64, NH=14, SPLITS=1, FP32_DOT=False, ROPE=True, BLOCK_N=64, **on
            ),
            stages=2,
        ),  # fmt: skip
        compile_kernel(
            attention_kernel._combine_splits_kernel,
            dict(NH=14, D=64, SPLITS=3, SPLITS_PAD=4, **on),
            overrides={"out_ptr": "*bf16"},
        ),  # fmt: skip
        compile_kernel(
            sampler._sample_combine_kernel,
            dict(
                GREEDY=False,
                SCALE=True,
                HAS_THRESHOLD=False,
                HAS_MIN_P=False,
                SPLITS=38,
                SPLITS_PAD=64,
                SPLIT_SIZE=4096,
                BLOCK_V=4096,
                ADVANCE=True,
                **on,
            ),
            overrides={"part_idx_ptr": "*i32"},
            warps=8,
        ),  # fmt: skip
    ]
    prefetching = [
        compile_kernel(
            gemm._gemm_nt_kernel,
            dict(
                HAS_BIAS=False,
                SILU_PAIRS=True,
                PARTIAL=False,
                FP32=False,
                ROW_RSTD=False,
                N_SS_PAD=1,
                RESIDUAL=False,
                SERIAL=False,
                BLOCK_M=64,
                BLOCK_N=128,
                BLOCK_K=64,
                PREFETCH=True,
                PF_LINE=64,
                PF_COLS=1,
                PF_K=896,
                **on,
            ),
        ),  # fmt: skip
        *[
            compile_kernel(  # the shared prefixes asked of L2 before the wait
                shared_prefix._prefix_attention_kernel,
                dict(G=7, NH=14, NKV=2, D=dim, M_PAD=64, BLOCK_N=64, FP32_DOT=False, **on),
                overrides={"groups_ptr": "*i32"},
                stages=3,
            )  # fmt: skip
            for dim in (64, 128)
        ],
    ]
    for kernel in compiled + prefetching:
        ptx = kernel.asm["ptx"]
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    for kernel in prefetching:
        ptx = kernel.asm["ptx"]
        assert "prefetch.global.L2" in ptx
        # the prefetch comes before the wait, every activation load after it
        assert ptx.index("prefetch.global.L2") < ptx.index("griddepcontrol.wait")
    # off by default: no grid dependency control in the plain kernels
    plain = compile_kernel(rowwise._rms_norm_kernel, dict(ADD=True, WEIGHT=True, BLOCK_H=1024))
    assert "griddepcontrol" not in plain.asm["ptx"]
