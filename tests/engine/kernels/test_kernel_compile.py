"""Every Triton kernel compiles for an H100/H200 (sm_90) target, on a machine without a GPU.

Why: the interpreter (TRITON_INTERPRET=1, the CPU kernel tests) runs kernels as numpy and
does not type-check them; a loop-carried variable that changes shape or a tl.dot with K < 16
only fails in the real compiler (one device call died that way). `triton.compile` with a
GPUTarget runs the whole pipeline down to the cubin with the bundled ptxas, no GPU needed.
Skipped without triton (the main CI run) and under the interpreter. The compiles run in a
pool of worker processes (tests/sm90_compile.py): each test submits its kernels, then reads
their PTX; one a test does not read still fails it, at its teardown."""

from __future__ import annotations

import inspect
import itertools
import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces compiled kernels", allow_module_level=True)

from sm90_compile import Compiled, compile_pool, compile_to_ptx  # noqa: E402

from hybridflow.engine.kernels import (
    attention,
    biased_experts,
    biased_grouped,
    chunk_attention,
    delta_step,
    delta_step_grouped,
    fp8_quant,
    gemm,
    gemm_persistent,
    grouped_route,
    latent_rope,
    moe,
    rowwise,
    sampler,
    shared_prefix,
)
from hybridflow.engine.layers import chain as chain_mod  # noqa: E402
from hybridflow.engine.layers import matmul_choice
from hybridflow.models.heads import fused_head_kernels, logprob_kernels  # noqa: E402

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


def _signature(fn, constexprs: dict, activation: str, overrides: dict) -> dict:
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


def _compile(fn, constexprs: dict, activation="bf16", overrides=None, warps=4, stages=3,
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
    signature = _signature(fn, constexprs, activation, overrides or {})
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
"""The module's compile workers, started at its first compile."""
PENDING: list[Compiled] = []
"""The compiles the running test asked for."""


@pytest.fixture(autouse=True, scope="module")
def _compile_workers():
    yield
    if POOL:
        POOL.pop().shutdown(cancel_futures=True)


@pytest.fixture(autouse=True)
def _every_compile_checked():
    """A compile no assertion read (e.g. the row kernels') must still have succeeded."""
    yield
    pending = PENDING[:]
    PENDING.clear()
    for compiled in pending:
        assert compiled.asm["ptx"]


def _row_kernels(activation: str) -> None:
    for add, weighted in [(True, True), (False, True), (True, False)]:
        norm = dict(ADD=add, WEIGHT=weighted, BLOCK_H=1024)
        _compile(rowwise._rms_norm_kernel, norm, activation, warps=4)
    zero_centered = dict(ADD=True, WEIGHT=True, BLOCK_H=4096, OFFSET=True)  # Qwen3.5's norms
    _compile(rowwise._rms_norm_kernel, zero_centered, activation, warps=4)
    _compile(rowwise._qk_norm_kernel, dict(NH=32, NKV=4, NH_PAD=32, NKV_PAD=4, D=128),
             activation)  # fmt: skip
    for pairs in (True, False):
        _compile(rowwise._silu_mul_kernel, dict(PAIRS=pairs, BLOCK=512), activation)
    _compile(rowwise._silu_mul_kernel, dict(PAIRS=True, BLOCK=512, NORM=True, H_PAD=2048),
             activation)  # lean.py's 1/rms from the residual row  # fmt: skip
    _compile(
        rowwise._rope_store_kernel,
        dict(NH=14, NKV=2, HALF=32, NH_PAD=16, NKV_PAD=2, K_IN_PLACE=True),
        activation,
    )
    _compile(
        attention._combine_splits_kernel,
        dict(NH=14, D=64, SPLITS=3, SPLITS_PAD=4),
        activation,
        overrides={"out_ptr": "*" + activation},
    )


def _attention(activation: str, stages: int = 2, **constexprs) -> None:
    base = dict(G=7, G_PAD=16, HALF=32, NH=14, SPLITS=1, ROPE=True, BLOCK_N=64)
    fp32_dot = dict(FP32_DOT=activation == "fp32")
    _compile(attention._decode_attention_kernel, {**base, **fp32_dot, **constexprs}, activation,
             stages=stages)  # fmt: skip


def _prefix(activation: str, group: int, dim: int, page: int) -> None:
    _compile(
        shared_prefix._prefix_attention_kernel,
        dict(G=group, NH=2 * group, NKV=2, D=dim, M_PAD=64, BLOCK_N=64,
             FP32_DOT=activation == "fp32", PAGE=page, PDL=True),
        activation, overrides={"groups_ptr": "*i32"}, stages=3,
    )  # fmt: skip


def test_decode_layer_kernels_compile():
    """bf16, the engine's dtype: every variant the engine launches."""
    _row_kernels("bf16")
    for rope in (True, False):
        for splits in (1, 3):
            for head_dim in (64, 128):
                _attention("bf16", ROPE=rope, SPLITS=splits, HALF=head_dim // 2)
    for bias in (True, False):  # lean.py: 1/rms and the qkv bias inside the kernel
        _attention("bf16", G=6, NH=12, HALF=64, BLOCK_N=32, NORM=True, H_PAD=2048,
                   HAS_BIAS=bias)  # fmt: skip
    for norm in (False, True):  # shared_prefix.py: the row kernel's half, with and without lean
        _attention("bf16", G=6, NH=12, HALF=64, NORM=norm, H_PAD=2048, HAS_BIAS=norm,
                   SHARED=True)  # fmt: skip
    # a paged cache: blocks the tiles fit in (aligned tiles), and smaller ones
    for (rope, shared), page in itertools.product(((True, False), (False, False), (True, True)),
                                                  (64, 16)):  # fmt: skip
        _attention("bf16", ROPE=rope, SPLITS=1 if shared else 3, SHARED=shared, PAGE=page)
    # mRoPE's per-slot rotary shift (a vision-language model): split, lean and shared rows
    _attention("bf16", ROPE_SHIFT=True, SPLITS=3, HALF=64)
    _attention("bf16", G=7, NH=28, HALF=64, BLOCK_N=32, NORM=True, H_PAD=4096, HAS_BIAS=True,
               ROPE_SHIFT=True, PAGE=64)  # fmt: skip
    _attention("bf16", G=7, NH=28, HALF=64, SHARED=True, ROPE_SHIFT=True, PAGE=64)
    # and the prefix kernel, at 0.5b's and 1.5b's heads, slot and paged caches
    for (group, dim), page in itertools.product(((7, 64), (6, 128)), (0, 16, 64)):
        _prefix("bf16", group, dim, page)


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
    _compile(delta_step._state_kernel, {**shape, "NORM": fused},
             overrides={**DELTA_TYPES, **out}, warps=warps)  # fmt: skip
    if block_v == 32:
        _compile(delta_step._qk_kernel, dict(DK=128, KERNEL=4, BLOCK_K=128),
                 overrides=DELTA_TYPES)  # fmt: skip
        _compile(delta_step._norm_kernel, dict(DV=128, BLOCK_V=128), overrides=DELTA_TYPES)
        _compile(delta_step_grouped._delta_step_kernel, shape,
                 overrides={**DELTA_TYPES, "out_ptr": "*fp32"})  # fmt: skip


def test_gated_attention_decode_compiles_at_head_dim_256():
    """Qwen3.5's gated attention through the decode kernel (layers/eager.py's triton step):
    head dim 256, 16 heads over 4 K/V heads, no RoPE in the kernel, slot and paged caches."""
    gated = dict(G=4, G_PAD=16, NH=16, HALF=128, ROPE=False, SPLITS=1)
    _attention("bf16", **gated, BLOCK_N=64)
    _attention("bf16", **gated, BLOCK_N=32, PAGE=64)


@pytest.mark.parametrize("activation", ["bf16", "fp32"])
@pytest.mark.parametrize("page", [0, 16])
def test_chunk_attention_kernel_compiles(activation, page):
    """The mixed step's chunk kernel (a causal [rows, keys] mask through the shared softmax
    tile), slot and paged, at a 7-head group (qwen2.5-0.5b's) and head dim 64."""
    _compile(chunk_attention._chunk_attention_kernel,
             dict(G=7, G_PAD=8, TOKENS=16, D=64, BLOCK=64, PAGE=page,
                  FP32_DOT=activation == "fp32"),
             activation, overrides={"pos_ptr": "*i64", "tile_ptr": "*i64"})  # fmt: skip


@pytest.mark.parametrize("activation", ["bf16", "fp32"])
def test_sink_prefill_kernels_compile(activation):
    """GPT-OSS's prefill (layers/sink.py, layers/biased_moe.py): the chunk kernel over packed
    prompts with a sink logit a head (the model's dtype) and a sliding window, at its
    64 heads over 8 K/V heads and head dim 64; the biased experts' clamped SwiGLU."""
    _compile(chunk_attention._chunk_attention_kernel,
             dict(G=8, G_PAD=8, TOKENS=chunk_attention.tile_tokens(64, 8), D=64, BLOCK=64,
                  PAGE=0, FP32_DOT=activation == "fp32", WINDOW=128, HAS_SINK=True),
             activation, overrides={"pos_ptr": "*i64", "tile_ptr": "*i64"})  # fmt: skip
    _compile(biased_experts._bias_clamped_swiglu_kernel, dict(BLOCK=biased_experts.BLOCK),
             activation, overrides={"expert_ptr": "*i64", "alpha": "fp32", "limit": "fp32"},
             divisible=("stride_x", "stride_b", "stride_o"))  # fmt: skip


def test_decode_layer_kernels_compile_in_fp32():
    """fp32 (FP32_DOT: IEEE dots, fp32 loads and stores): the dtype changes only the dots and
    the pointers, so each flag once, at 0.5b's head dim. Each variant at 1.5b's would take
    ptxas about a minute of unrolled fp32 FMAs, for nothing the bf16 variants do not check."""
    _row_kernels("fp32")
    _attention("fp32", SPLITS=3)  # the new token from registers, partial outputs
    _attention("fp32", ROPE=False)
    _attention("fp32", G=6, NH=12, BLOCK_N=32, NORM=True, H_PAD=2048, HAS_BIAS=True)
    _attention("fp32", SHARED=True, PAGE=16)
    _attention("fp32", ROPE=False, SPLITS=3, PAGE=64)
    _prefix("fp32", 7, 64, 16)


@pytest.mark.parametrize("block_m", [16, 128])  # decode's smallest block, prefill's
def test_moe_kernels_compile(block_m):
    """Routing (with its record), the sort by expert, both grouped matmuls at each block's
    tile (tensor-core dots, no atomics: the order is fixed) and the combine."""
    ints = {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
            "total_ptr": "*i32", "ends_ptr": "*i32", "counts_ptr": "*i32"}  # fmt: skip
    routing = {**ints, "weights_ptr": "*fp32", "logits_ptr": "*bf16", "routes_ptr": "*u8",
               "entry_ptr": "*i64", "offset_ptr": "*i64"}  # fmt: skip
    _compile(moe._topk_kernel, dict(TOP_K=8, K_PAD=8, E_PAD=128, BLOCK_T=16, RENORM=True,
                                    RECORD=True), overrides=routing)  # fmt: skip
    # the sort by expert: the counts, then the placement (decode: 2048 pairs, 128 experts)
    _compile(moe._count_kernel, dict(CHUNK=2048), overrides=ints, warps=8)
    _compile(moe._align_kernel, dict(BINS=128, BLOCK_M=block_m, CHUNK=2048), overrides=ints,
             warps=8)  # fmt: skip
    grouped = []
    for silu in (True, False):
        block_n, block_k, warps, stages = moe.TILES[block_m]["gate_up" if silu else "down"]
        grouped.append(_compile(
            moe._grouped_kernel,
            dict(TOP_K=8, GATHER=silu, SILU_UP=silu, FP32=False, BLOCK_M=block_m,
                 BLOCK_N=block_n, BLOCK_K=block_k),
            overrides=ints, warps=warps, stages=stages,
            divisible=("P", "N", "K", "stride_am", "stride_we", "stride_wn", "stride_cm", "up_rows"),
        ))  # fmt: skip
    _compile(moe._combine_kernel, dict(TOP_K=8, BLOCK_H=2048), overrides={"w_ptr": "*fp32"})
    for compiled in grouped:
        ptx = compiled.asm["ptx"]  # pipelined (async copies), tensor cores, no atomics
        assert "cp.async" in ptx and "mma" in ptx and "atom" not in ptx


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
        grouped.append(_compile(
            biased_grouped._grouped_in_out_kernel,
            dict(TOP_K=4, GATE_UP=gate_up, FP32=False, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=block_k),
            overrides={**ints, "alpha": "fp32", "limit": "fp32"}, warps=warps, stages=stages,
            divisible=("N", "K", "stride_am", "stride_we", "stride_wk", "stride_cm",
                       "stride_be"),
        ))  # fmt: skip
    routing = {"logits_ptr": "*fp32", "correction_ptr": "*fp32", "ids_ptr": "*i32",
               "weights_ptr": "*fp32", "routes_ptr": "*u8", "entry_ptr": "*i64",
               "offset_ptr": "*i64", "scaling": "fp32"}  # fmt: skip
    for groups, chosen in ((8, 4), (1, 1)):
        _compile(grouped_route._grouped_route_kernel,
                 dict(TOP_K=8, K_PAD=8, E_PAD=256, N_GROUP=groups, G_PAD=max(groups, 2),
                      TOPK_GROUP=chosen, GROUP_SIZE=256 // groups, BLOCK_T=16, RENORM=True,
                      RECORD=True), overrides=routing)  # fmt: skip
    rope = {"entry_ptr": "*i64", "offset_ptr": "*i64"}
    for heads in (16, 128):
        _compile(latent_rope._latent_rope_store_kernel,
                 dict(NOPE=128, HALF=32, HALF_PAD=32, RANK=512, RANK_PAD=512,
                      HEADS_PAD=heads, INTERLEAVED=True), overrides=rope)  # fmt: skip
    for compiled in grouped:
        ptx = compiled.asm["ptx"]  # tensor cores, no atomics
        assert "mma" in ptx and "atom" not in ptx


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
        _compile(
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
    compiled = _compile(
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
        _compile(gemm._gemm_nt_kernel, dict(**flags, **plain, **tiles), overrides=fp32,
                 warps=warps, stages=stages)
        for flags in variants
    ]  # fmt: skip
    for flags, kernel in zip(variants, compiled):
        if flags["SERIAL"]:
            assert "atom" in kernel.asm["ptx"]


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
        _compile(
            sampler._split_stats_kernel,
            dict(common, MAX_ONLY=max_only),
            overrides=part_idx,
            warps=8,
        )
    for advance in (True, False):
        _compile(
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
        _compile(fp8_quant._quantize_rows_kernel, dict(BLOCK_K=2048), overrides=e4m3, warps=8)
    ]
    for add, weighted in [(True, True), (False, True), (True, False)]:
        norm = dict(ADD=add, WEIGHT=weighted, BLOCK_H=2048, E4M3=True, **on)
        compiled.append(_compile(rowwise._rms_norm_kernel, norm, overrides=e4m3))
    for pairs in (True, False):
        silu = dict(PAIRS=pairs, BLOCK=rowwise.SILU_E4M3_BLOCK, **on)
        compiled.append(_compile(rowwise._silu_mul_e4m3_kernel, silu, overrides=e4m3, warps=8))
    for kernel in compiled:
        assert "e4m3x2" in kernel.asm["ptx"]
    if pdl:  # the standalone quantizer takes no PDL launch
        assert all("griddepcontrol.wait" in kernel.asm["ptx"] for kernel in compiled[1:])


def test_fp8_kv_cache_kernels_compile_with_the_hardware_casts():
    """An FP8 KV cache (cache/fp8_kv.py): the new token's store and rope_store quantize
    (cvt...e4m3x2), decode attention dequantizes its tiles (e4m3 loads converted up)."""
    fp8 = {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    compiled = []
    for rope, page, splits in ((True, 16, 3), (True, 64, 1), (False, 64, 3)):
        base = dict(G=7, G_PAD=16, HALF=32, NH=14, SPLITS=splits, ROPE=rope, BLOCK_N=64,
                    FP32_DOT=False, PAGE=page, KV_FP8=True)  # fmt: skip
        compiled.append(_compile(attention._decode_attention_kernel, base, "bf16",
                                 overrides=fp8, stages=2))  # fmt: skip
    compiled.append(_compile(attention._decode_attention_kernel,
                             dict(G=6, G_PAD=16, HALF=64, NH=12, SPLITS=1, ROPE=True, BLOCK_N=32,
                                  FP32_DOT=False, PAGE=64, KV_FP8=True, NORM=True, H_PAD=2048,
                                  HAS_BIAS=True),
                             "bf16", overrides=fp8, stages=2))  # lean.py's  # fmt: skip
    compiled.append(_compile(rowwise._rope_store_kernel,
                             dict(NH=14, NKV=2, HALF=32, NH_PAD=16, NKV_PAD=2, K_IN_PLACE=True,
                                  KV_FP8=True),
                             "bf16", overrides=fp8))  # fmt: skip
    stores = [compiled[0], compiled[1], compiled[3], compiled[4]]
    assert all("e4m3x2" in kernel.asm["ptx"] for kernel in stores)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_logprob_kernels_compile(with_entropy):
    constexprs = dict(WITH_ENTROPY=with_entropy, BLOCK=logprob_kernels.BLOCK_V)
    _compile(logprob_kernels._stats_kernel, constexprs, warps=8)
    _compile(logprob_kernels._grad_kernel, constexprs, warps=8)


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
        _compile(kernel, constexprs, activation, overrides, warps=k.NUM_WARPS,
                 stages=k.NUM_STAGES, divisible=("stride_h", "stride_w", "H"))
        for kernel, overrides in [(k._forward_kernel, partials), (k._grad_tile_kernel, {})]
    ]  # fmt: skip
    for kernel in compiled:
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "atom" not in ptx


def test_pdl_variants_compile_with_grid_dependency_control():
    """With PDL every kernel waits on the previous one (griddepcontrol.wait) and lets the next
    launch; the matmul and the shared-prefix kernel also prefetch into L2 before the wait
    (pdl.py)."""
    on = dict(PDL=True)
    compiled = [
        _compile(
            rowwise._rms_norm_kernel, dict(ADD=True, WEIGHT=True, BLOCK_H=1024, **on)
        ),  # fmt: skip
        _compile(
            attention._decode_attention_kernel,
            dict(
                G=7, G_PAD=16, HALF=64, NH=14, SPLITS=1, FP32_DOT=False, ROPE=True, BLOCK_N=64, **on
            ),
            stages=2,
        ),  # fmt: skip
        _compile(
            attention._combine_splits_kernel,
            dict(NH=14, D=64, SPLITS=3, SPLITS_PAD=4, **on),
            overrides={"out_ptr": "*bf16"},
        ),  # fmt: skip
        _compile(
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
        _compile(
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
            _compile(  # the shared prefixes asked of L2 before the wait
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
    plain = _compile(rowwise._rms_norm_kernel, dict(ADD=True, WEIGHT=True, BLOCK_H=1024))
    assert "griddepcontrol" not in plain.asm["ptx"]


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
        _compile(
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
