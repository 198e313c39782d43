"""The decode layer's attention kernels (kernels/attention_kernel.py, shared_prefix.py,
chunk_attention.py) and its row kernels (rowwise.py) compile for sm_90: how and why in
test_kernel_compile.py."""

from __future__ import annotations

import itertools
import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces compiled kernels", allow_module_level=True)

from sm90_compile import compile_kernel  # noqa: E402

from hybridflow.engine.kernels import (  # noqa: E402
    attention_kernel,
    chunk_attention,
    rowwise,
    shared_prefix,
)
from hybridflow.engine.kernels.experts import biased_experts  # noqa: E402


def _row_kernels(activation: str) -> None:
    for add, weighted in [(True, True), (False, True), (True, False)]:
        norm = dict(ADD=add, WEIGHT=weighted, BLOCK_H=1024)
        compile_kernel(rowwise._rms_norm_kernel, norm, activation, warps=4)
    zero_centered = dict(ADD=True, WEIGHT=True, BLOCK_H=4096, OFFSET=True)  # Qwen3.5's norms
    compile_kernel(rowwise._rms_norm_kernel, zero_centered, activation, warps=4)
    compile_kernel(rowwise._qk_norm_kernel, dict(NH=32, NKV=4, NH_PAD=32, NKV_PAD=4, D=128),
                   activation)  # fmt: skip
    for pairs in (True, False):
        compile_kernel(rowwise._silu_mul_kernel, dict(PAIRS=pairs, BLOCK=512), activation)
    compile_kernel(rowwise._silu_mul_kernel, dict(PAIRS=True, BLOCK=512, NORM=True, H_PAD=2048),
                   activation)  # lean.py's 1/rms from the residual row  # fmt: skip
    compile_kernel(
        rowwise._rope_store_kernel,
        dict(NH=14, NKV=2, HALF=32, NH_PAD=16, NKV_PAD=2, K_IN_PLACE=True),
        activation,
    )
    compile_kernel(
        attention_kernel._combine_splits_kernel,
        dict(NH=14, D=64, SPLITS=3, SPLITS_PAD=4),
        activation,
        overrides={"out_ptr": "*" + activation},
    )


def _attention(activation: str, stages: int = 2, **constexprs) -> None:
    base = dict(G=7, G_PAD=16, HALF=32, NH=14, SPLITS=1, ROPE=True, BLOCK_N=64)
    fp32_dot = dict(FP32_DOT=activation == "fp32")
    compile_kernel(attention_kernel._decode_attention_kernel, {**base, **fp32_dot, **constexprs}, activation,
                   stages=stages)  # fmt: skip


def _prefix(activation: str, group: int, dim: int, page: int) -> None:
    compile_kernel(
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
    compile_kernel(chunk_attention._chunk_attention_kernel,
                   dict(G=7, G_PAD=8, TOKENS=16, D=64, BLOCK=64, PAGE=page,
                        FP32_DOT=activation == "fp32"),
                   activation, overrides={"pos_ptr": "*i64", "tile_ptr": "*i64"})  # fmt: skip


@pytest.mark.parametrize("activation", ["bf16", "fp32"])
def test_sink_prefill_kernels_compile(activation):
    """GPT-OSS's prefill (layers/sink.py, layers/biased_moe.py): the chunk kernel over packed
    prompts with a sink logit a head (the model's dtype) and a sliding window, at its
    64 heads over 8 K/V heads and head dim 64; the biased experts' clamped SwiGLU."""
    compile_kernel(chunk_attention._chunk_attention_kernel,
                   dict(G=8, G_PAD=8, TOKENS=chunk_attention.tile_tokens(64, 8), D=64, BLOCK=64,
                        PAGE=0, FP32_DOT=activation == "fp32", WINDOW=128, HAS_SINK=True),
                   activation, overrides={"pos_ptr": "*i64", "tile_ptr": "*i64"})  # fmt: skip
    compile_kernel(biased_experts._bias_clamped_swiglu_kernel, dict(BLOCK=biased_experts.BLOCK),
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


def test_fp8_kv_cache_kernels_compile_with_the_hardware_casts():
    """An FP8 KV cache (cache/fp8_kv.py): the new token's store and rope_store quantize
    (cvt...e4m3x2), decode attention dequantizes its tiles (e4m3 loads converted up)."""
    fp8 = {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    compiled = []
    for rope, page, splits in ((True, 16, 3), (True, 64, 1), (False, 64, 3)):
        base = dict(G=7, G_PAD=16, HALF=32, NH=14, SPLITS=splits, ROPE=rope, BLOCK_N=64,
                    FP32_DOT=False, PAGE=page, KV_FP8=True)  # fmt: skip
        compiled.append(compile_kernel(attention_kernel._decode_attention_kernel, base, "bf16",
                                       overrides=fp8, stages=2))  # fmt: skip
    compiled.append(compile_kernel(attention_kernel._decode_attention_kernel,
                                   dict(G=6, G_PAD=16, HALF=64, NH=12, SPLITS=1, ROPE=True, BLOCK_N=32,
                                        FP32_DOT=False, PAGE=64, KV_FP8=True, NORM=True, H_PAD=2048,
                                        HAS_BIAS=True),
                                   "bf16", overrides=fp8, stages=2))  # lean.py's  # fmt: skip
    compiled.append(compile_kernel(rowwise._rope_store_kernel,
                                   dict(NH=14, NKV=2, HALF=32, NH_PAD=16, NKV_PAD=2, K_IN_PLACE=True,
                                        KV_FP8=True),
                                   "bf16", overrides=fp8))  # fmt: skip
    stores = [compiled[0], compiled[1], compiled[3], compiled[4]]
    assert all("e4m3x2" in kernel.asm["ptx"] for kernel in stores)
