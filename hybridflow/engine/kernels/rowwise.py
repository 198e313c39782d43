"""Fused Triton kernels for the decode layers (CUDA; run on CPU under TRITON_INTERPRET=1 in tests).

Why: at decode batch sizes every op is memory- or launch-bound, and an eager step of a 24-layer
model is ~40 tiny kernels per layer. Fusing RMSNorm with the residual add, RoPE with the cache
store and SiLU with the up projection cuts that to ~9 per layer (the rest are cuBLAS matmuls;
the sampler is in sampler_kernels.py, decode attention in attention_kernels.py). For an fp8
matmul (fp8.py) the norms and SiLU*up also write their output as e4m3 rows with per-row
scales (the *_e4m3 functions), so no quantize launch sits between them and the matmul.

Rounding follows the torch ops they replace (results cast to the activation dtype where torch
would), so bf16 outputs stay within a rounding step of the eager path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.fp8.e4m3 import TINY, Fp8Rows
from hybridflow.engine.kernels.fp8_quant import e4m3_values, empty_rows, row_scale
from hybridflow.engine.kernels.launch import PLAIN, Launch
from hybridflow.engine.kernels.pdl import wait_then_release

_TINY = tl.constexpr(TINY)

# -------------------------------------------------------------------------------------------
# RMSNorm, residual add + RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_o, H, eps,
    ADD: tl.constexpr, WEIGHT: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
    scale_ptr=None, tiny=0.0, E4M3: tl.constexpr = False, OFFSET: tl.constexpr = False,
):  # fmt: skip
    """One row per program (on 4 warps: the fastest on the H200 at 256, 1024 and 16384 rows;
    4 rows a program took 2.18 vs 1.94 us at 256 rows). E4M3: out is e4m3 and scale_ptr [B]
    fp32 gets each row's scale (fp8_quant.py), from the output rounded to x's dtype as the
    plain kernel stores it, so the two match quantize_rows of that output bit for bit.
    OFFSET: the weight is stored as an offset from 1 (a ZeroCenteredRMSNorm's: x * (1 + w),
    in fp32 as that module computes it)."""
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / H
    y = xf * tl.rsqrt(variance + eps)
    if WEIGHT:  # else the weight is folded into the next matmul (FusedProjections)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if OFFSET:
            w = w + 1.0
        y = y * w
    if E4M3:  # after the weight: the scale is the max of what the matmul reads
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), axis=0), tiny)
        tl.store(scale_ptr + row, scale)
        y = e4m3_values(y, scale)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(x, delta, norm, out, add: bool, weighted: bool,
                     launch: Launch, scale: torch.Tensor | None = None) -> None:  # fmt: skip
    """norm: the model's RMSNorm or ZeroCenteredRMSNorm module (its weight and eps). scale:
    out is e4m3 and scale [B, 1] fp32 receives the rows' scales."""
    from hybridflow.models.norm import ZeroCenteredRMSNorm

    rows, hidden = x.shape
    e4m3 = {} if scale is None else dict(scale_ptr=scale, tiny=TINY, E4M3=True)
    _rms_norm_kernel[(rows,)](
        x, delta, norm.weight, out, x.stride(0), delta.stride(0), out.stride(0), hidden,
        norm.eps, ADD=add, WEIGHT=weighted, BLOCK_H=triton.next_power_of_2(hidden), num_warps=4,
        OFFSET=isinstance(norm, ZeroCenteredRMSNorm), **launch.keywords(), **e4m3,
    )  # fmt: skip


def rms_norm(x: torch.Tensor, norm, weighted: bool = True, launch: Launch = PLAIN) -> torch.Tensor:
    """x [B, H] -> RMSNorm(x) * norm.weight [B, H] (norm: the model's RMSNorm module, or a
    ZeroCenteredRMSNorm: * (1 + weight); without `weighted`, the weight is left to the next
    matmul)."""
    out = torch.empty_like(x)
    _launch_rms_norm(x, x, norm, out, False, weighted, launch)
    return out


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, norm, weighted: bool = True,
    launch: Launch = PLAIN,
) -> torch.Tensor:  # fmt: skip
    """residual += delta (in place, [B, H]); returns RMSNorm(residual) * norm.weight (without
    `weighted`: not multiplied by the weight)."""
    out = torch.empty_like(residual)
    _launch_rms_norm(residual, delta, norm, out, True, weighted, launch)
    return out


def rms_norm_e4m3(x: torch.Tensor, norm, weighted: bool = True,
                  launch: Launch = PLAIN) -> Fp8Rows:  # fmt: skip
    """rms_norm(x, norm, weighted) as e4m3 rows with per-row scales (fp8.quantize_rows of
    it, in the norm's own launch)."""
    out = empty_rows(*x.shape, x.device)
    _launch_rms_norm(x, x, norm, out.values, False, weighted, launch, out.scale)
    return out


def add_rms_norm_e4m3(
    residual: torch.Tensor, delta: torch.Tensor, norm, weighted: bool = True,
    launch: Launch = PLAIN,
) -> Fp8Rows:  # fmt: skip
    """add_rms_norm (residual += delta in place) with its output as e4m3 rows and scales."""
    out = empty_rows(*residual.shape, residual.device)
    _launch_rms_norm(residual, delta, norm, out.values, True, weighted, launch, out.scale)
    return out


# -------------------------------------------------------------------------------------------
# Qwen3's q/k norms: an RMSNorm over head_dim of each head, in place


@triton.jit
def _norm_heads(ptr, w_ptr, row, stride, eps, HEADS: tl.constexpr, PAD: tl.constexpr,
                D: tl.constexpr):  # fmt: skip
    head = tl.arange(0, PAD)
    cols = tl.arange(0, D)
    offs = row * stride + head[:, None] * D + cols[None, :]
    mask = (head < HEADS)[:, None]
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * tl.load(w_ptr + cols).to(tl.float32)[None, :]
    tl.store(ptr + offs, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, stride_q, stride_k, eps, NH: tl.constexpr,
                    NKV: tl.constexpr, NH_PAD: tl.constexpr, NKV_PAD: tl.constexpr,
                    D: tl.constexpr):  # fmt: skip
    """One row a program: q [NH, D] and k [NKV, D] (rows strided, heads contiguous) scaled by
    each head's 1/rms and the norm weights, in place, rounded once as F.rms_norm."""
    row = tl.program_id(0).to(tl.int64)
    _norm_heads(q_ptr, qw_ptr, row, stride_q, eps, NH, NH_PAD, D)
    _norm_heads(k_ptr, kw_ptr, row, stride_k, eps, NKV, NKV_PAD, D)


def qk_norm_(q: torch.Tensor, k: torch.Tensor, q_norm, k_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, NH, D], k [N, NKV, D] (views of one projection's rows) -> q_norm(q), k_norm(k),
    written in place: one launch where the torch norms take two and a copy of each strided
    input (H200, 30B-A3B decode at 256 rows: ~1.6 ms a step)."""
    rows, heads, dim = q.shape
    if rows:
        _qk_norm_kernel[(rows,)](
            q, k, q_norm.weight, k_norm.weight, q.stride(0), k.stride(0), q_norm.eps, NH=heads,
            NKV=k.shape[1], NH_PAD=triton.next_power_of_2(heads),
            NKV_PAD=triton.next_power_of_2(k.shape[1]), D=dim, num_warps=4,
        )  # fmt: skip
    return q, k


# -------------------------------------------------------------------------------------------
# SiLU(gate) * up


@triton.jit
def _load_gate_up(g_ptr, u_ptr, row, cols, mask, stride_g, stride_u, PAIRS: tl.constexpr):
    """gate and up at `cols` of `row`, fp32. PAIRS: g_ptr rows hold (gate_0, up_0, gate_1,
    up_1, ...), read as [BLOCK, 2] tiles (contiguous, vectorised) and split; else gate and up
    are separate rows."""
    if PAIRS:
        two = tl.arange(0, 2)
        offs = row * stride_g + cols[:, None] * 2 + two[None, :]
        pairs = tl.load(g_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
        g, u = tl.split(pairs)
    else:
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def _silu_times_up(g, u, dtype: tl.constexpr):
    """silu(g) * u in fp32, silu(g) rounded to `dtype` first as torch does."""
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return silu * u


@triton.jit
def _silu_mul_kernel(
    g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_o, n, PAIRS: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False, h_ptr=None, stride_h=0, H=1, eps=0.0,
    NORM: tl.constexpr = False, H_PAD: tl.constexpr = 16,
):  # fmt: skip
    """PAIRS: see _load_gate_up. NORM: gate and up are residual @ W^T with the RMSNorm weight
    folded into W; each is scaled by the row's 1/rms(residual) (h [B, H]) and rounded to the
    activation dtype first (lean.py)."""
    wait_then_release(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g, u = _load_gate_up(g_ptr, u_ptr, row, cols, mask, stride_g, stride_u, PAIRS)
    dtype = out_ptr.dtype.element_ty
    if NORM:
        hcols = tl.arange(0, H_PAD)
        hrow = tl.load(h_ptr + row * stride_h + hcols, mask=hcols < H, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hrow * hrow, axis=0) / H + eps)
        g = (g * rstd).to(dtype).to(tl.float32)
        u = (u * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _silu_times_up(g, u, dtype).to(dtype), mask=mask)


@triton.jit
def _silu_mul_e4m3_kernel(
    g_ptr, u_ptr, out_ptr, scale_ptr, stride_g, stride_u, stride_o, n, tiny,
    PAIRS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """silu(gate) * up as e4m3 rows (out) and per-row scales (scale_ptr [B] fp32), one row
    per program since the row's max sets its scale. Two passes over the row: the second
    recomputes the products from gate/up (read again, from L2) rather than hold a row of
    products in registers. Each product is rounded to the activation dtype before its max
    and its quantization, as _silu_mul_kernel then quantize_rows would."""
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = g_ptr.dtype.element_ty
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        g, u = _load_gate_up(g_ptr, u_ptr, row, cols, cols < n, stride_g, stride_u, PAIRS)
        act = _silu_times_up(g, u, dtype).to(dtype).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(act))
    scale = row_scale(tl.max(amax, axis=0), tiny)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n
        g, u = _load_gate_up(g_ptr, u_ptr, row, cols, mask, stride_g, stride_u, PAIRS)
        act = _silu_times_up(g, u, dtype).to(dtype).to(tl.float32)
        x8 = e4m3_values(act, scale).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, x8, mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, launch: Launch = PLAIN) -> torch.Tensor:
    """silu(gate) * up, both [B, I] with contiguous rows (may be halves of one [B, 2I])."""
    rows, inner = gate.shape
    assert gate.stride(1) == 1 and up.stride(1) == 1
    out = torch.empty(rows, inner, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inner, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), inner, PAIRS=False,
        BLOCK=block, **launch.keywords(),
    )  # fmt: skip
    return out


# Pairs per program of silu_mul_pairs, with or without the norm (lean.py). H200: 1024 against
# 512 took 4.1 vs 6.8 us at 1.5b/256, 7.6 vs 13.8 at 0.5b/1024, 2.4 vs 3.8 at 0.5b/256 (2048:
# 4.5 / 7.1 / 3.4); with the norm 1024 was fastest at all three (5.5 / 9.3 / 3.9).
SILU_BLOCK = 1024


def silu_mul_pairs(
    product: torch.Tensor, norm: tuple | None = None, launch: Launch = PLAIN
) -> torch.Tensor:
    """[B, 2I] with columns interleaved (gate_0, up_0, gate_1, ...) -> silu(gate) * up
    [B, I] (the matmul output of FusedProjections' interleaved gate/up weight).

    norm: (residual [B, H], eps): the product is residual @ W^T with the RMSNorm weight
    folded into W; gate and up are first scaled by each row's 1/rms(residual)."""
    rows, width = product.shape
    assert product.stride(1) == 1 and width % 2 == 0
    inner = width // 2
    out = torch.empty(rows, inner, dtype=product.dtype, device=product.device)
    block = SILU_BLOCK
    extra = {}
    if norm is not None:
        residual, eps = norm
        assert residual.stride(1) == 1 and residual.shape[0] == rows
        extra = dict(h_ptr=residual, stride_h=residual.stride(0), H=residual.shape[1], eps=eps,
                     NORM=True, H_PAD=triton.next_power_of_2(residual.shape[1]))  # fmt: skip
    _silu_mul_kernel[(rows, triton.cdiv(inner, block))](
        product, product, out, product.stride(0), product.stride(0), out.stride(0), inner,
        PAIRS=True, BLOCK=block, **launch.keywords(), **extra,
    )  # fmt: skip
    return out


# Columns per loop step of the e4m3 SiLU*up (a program per row, 8 warps): the standalone
# quantizer's shape (fp8_quant.py), not yet timed against others.
SILU_E4M3_BLOCK = 2048


def _launch_silu_mul_e4m3(gate, up, stride_g, stride_u, inner, pairs: bool,
                          launch: Launch) -> Fp8Rows:  # fmt: skip
    out = empty_rows(gate.shape[0], inner, gate.device)
    _silu_mul_e4m3_kernel[(gate.shape[0],)](
        gate, up, out.values, out.scale, stride_g, stride_u, out.values.stride(0), inner, TINY,
        PAIRS=pairs, BLOCK=SILU_E4M3_BLOCK, num_warps=8, **launch.keywords(),
    )  # fmt: skip
    return out


def silu_mul_e4m3(gate: torch.Tensor, up: torch.Tensor, launch: Launch = PLAIN) -> Fp8Rows:
    """silu_mul(gate, up) as e4m3 rows with per-row scales (fp8.quantize_rows of it, in one
    launch)."""
    assert gate.stride(1) == 1 and up.stride(1) == 1 and gate.shape == up.shape
    return _launch_silu_mul_e4m3(gate, up, gate.stride(0), up.stride(0), gate.shape[1], False,
                                 launch)  # fmt: skip


def silu_mul_pairs_e4m3(product: torch.Tensor, launch: Launch = PLAIN) -> Fp8Rows:
    """silu_mul_pairs(product) (no norm) as e4m3 rows with per-row scales."""
    assert product.stride(1) == 1 and product.shape[1] % 2 == 0
    return _launch_silu_mul_e4m3(product, product, product.stride(0), product.stride(0),
                                 product.shape[1] // 2, True, launch)  # fmt: skip


# -------------------------------------------------------------------------------------------
# Norm weights folded into stacked projection weights (FusedProjections.refresh)


@triton.jit
def _fold_kernel(w_ptr, n_ptr, R, H, stride_l, stride_r, stride_n, BLOCK_R: tl.constexpr,
                 BLOCK_H: tl.constexpr):  # fmt: skip
    layer = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ptr = w_ptr + layer * stride_l + rows.to(tl.int64)[:, None] * stride_r
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = (rows < R)[:, None] & (cols < H)[None, :]
        w = tl.load(row_ptr + cols[None, :], mask=mask, other=0.0)
        g = tl.load(n_ptr + layer * stride_n + cols, mask=cols < H, other=0.0)
        folded = w.to(tl.float32) * g.to(tl.float32)[None, :]  # exact: bf16 x bf16 fits fp32
        tl.store(row_ptr + cols[None, :], folded.to(w_ptr.dtype.element_ty), mask=mask)


def fold_norm_weights(weights: torch.Tensor, norms: torch.Tensor) -> None:
    """weights [L, R, H] *= norms [L, H] (broadcast over R) in place, the product in fp32 and
    rounded once: bitwise torch's `weights.mul_(norms[:, None, :])`, which on the H200 ran a
    non-vectorised broadcast kernel at ~0.7 TB/s (4.6 ms at every 1.5b generate())."""
    layers, rows, hidden = weights.shape
    assert weights.stride(2) == 1 and norms.stride(1) == 1 and norms.shape == (layers, hidden)
    block_r, block_h = 16, min(1024, triton.next_power_of_2(hidden))
    _fold_kernel[(triton.cdiv(rows, block_r), layers)](
        weights, norms, rows, hidden, weights.stride(0), weights.stride(1), norms.stride(0),
        BLOCK_R=block_r, BLOCK_H=block_h,
    )  # fmt: skip


# -------------------------------------------------------------------------------------------
# RoPE on q (in place) and k, then k and v stored into the cache


@triton.jit
def _rotate(x1, x2, c, s, dtype: tl.constexpr):
    """HF rotate_half RoPE on halves x1, x2 [heads, half]; rounding like torch in `dtype`."""
    a1 = (x1 * c).to(dtype).to(tl.float32)
    b1 = (-x2 * s).to(dtype).to(tl.float32)
    a2 = (x2 * c).to(dtype).to(tl.float32)
    b2 = (x1 * s).to(dtype).to(tl.float32)
    return (a1 + b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, cpos_ptr, kc_ptr, vc_ptr,
    stride_q, stride_k, stride_v, stride_cs, stride_cslot, stride_cpos, stride_chead,
    NH: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr,
    NH_PAD: tl.constexpr, NKV_PAD: tl.constexpr, K_IN_PLACE: tl.constexpr = False,
    PDL: tl.constexpr = False, ks_ptr=None, vs_ptr=None, stride_sslot=0, stride_spos=0,
    KV_FP8: tl.constexpr = False,
):  # fmt: skip
    """KV_FP8 (cache/fp8_kv.py): k and v stored as e4m3 with a scale per kv head at
    ks/vs[slot, cache_pos, head]; a k rotated in place stays in the activation dtype."""
    wait_then_release(PDL)
    row = tl.program_id(0)
    pos = tl.load(pos_ptr + row)
    slot = tl.load(slot_ptr + row)
    cache_pos = tl.load(cpos_ptr + row)
    dtype = q_ptr.dtype.element_ty
    half = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * stride_cs + half).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cs + half).to(tl.float32)[None, :]
    # q [NH, 2 * HALF], rotated in place
    heads = tl.arange(0, NH_PAD)[:, None]
    mask = heads < NH
    q_base = q_ptr + row * stride_q + heads * (2 * HALF) + half[None, :]
    q1 = tl.load(q_base, mask=mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_base + HALF, mask=mask, other=0.0).to(tl.float32)
    r1, r2 = _rotate(q1, q2, c, s, dtype)
    tl.store(q_base, r1, mask=mask)
    tl.store(q_base + HALF, r2, mask=mask)
    # k rotated, k and v into cache[slot, cache_pos]
    kv_heads = tl.arange(0, NKV_PAD)[:, None]
    kv_mask = kv_heads < NKV
    kv_offs = kv_heads * (2 * HALF) + half[None, :]
    k1 = tl.load(k_ptr + row * stride_k + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + row * stride_k + kv_offs + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    r1, r2 = _rotate(k1, k2, c, s, dtype)
    cache_offs = (slot * stride_cslot + cache_pos * stride_cpos + kv_heads * stride_chead
                  + half[None, :])  # fmt: skip
    if K_IN_PLACE:
        tl.store(k_ptr + row * stride_k + kv_offs, r1, mask=kv_mask)
        tl.store(k_ptr + row * stride_k + kv_offs + HALF, r2, mask=kv_mask)
    v1 = tl.load(v_ptr + row * stride_v + kv_offs, mask=kv_mask, other=0.0)
    v2 = tl.load(v_ptr + row * stride_v + kv_offs + HALF, mask=kv_mask, other=0.0)
    if KV_FP8:
        scale_offs = slot.to(tl.int64) * stride_sslot + cache_pos.to(tl.int64) * stride_spos
        scale_offs += tl.arange(0, NKV_PAD)
        heads_mask = tl.arange(0, NKV_PAD) < NKV
        r1, r2, k_scale = _quantize_halves(r1, r2)
        v1, v2, v_scale = _quantize_halves(v1, v2)
        tl.store(ks_ptr + scale_offs, k_scale, mask=heads_mask)
        tl.store(vs_ptr + scale_offs, v_scale, mask=heads_mask)
    element = kc_ptr.dtype.element_ty
    tl.store(kc_ptr + cache_offs, r1.to(element), mask=kv_mask)
    tl.store(kc_ptr + cache_offs + HALF, r2.to(element), mask=kv_mask)
    tl.store(vc_ptr + cache_offs, v1.to(element), mask=kv_mask)
    tl.store(vc_ptr + cache_offs + HALF, v2.to(element), mask=kv_mask)


@triton.jit
def _quantize_halves(x1, x2):
    """Each head's vector, as halves x1, x2 [heads, half], quantized on its own (fp8_kv.py):
    (e4m3 values of x1, of x2, held in fp32, and the scale [heads])."""
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
    scale = row_scale(amax, _TINY)
    return e4m3_values(x1, scale[:, None]), e4m3_values(x2, scale[:, None]), scale


def rope_store(
    q,
    k,
    v,
    cos,
    sin,
    positions,
    row_slots,
    key_cache,
    value_cache,
    rotate_k: bool = False,
    launch: Launch = PLAIN,
    cache_positions=None,
    kv_scales: tuple | None = None,
) -> None:
    """q [B, nh, D] rotated in place; rotated k [B, nkv, D] and v stored at
    cache[row_slots, positions] (key_cache/value_cache: one layer, [slots, S, nkv, D], any
    slot/position/head strides, D contiguous). rotate_k: k is rotated in place too (prefill
    hands it to the packed attention as is, instead of gathering it back from the cache).
    q/k/v rows may be strided (views of matmul outputs); heads and dims contiguous.
    cache_positions: where in row_slots' entries the K/V go when that is not the RoPE position
    (a paged cache: row_slots are blocks, cache_positions the offsets in them). kv_scales:
    an FP8 cache's (key scales, value scales) of this layer [entries, positions, nkv]
    (cache/fp8_kv.py), the caches then e4m3."""
    rows, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == head_dim and k.stride(1) == head_dim
    fp8 = {}
    if kv_scales is not None:
        key_scales, value_scales = kv_scales
        assert key_scales.stride() == value_scales.stride() and key_scales.stride(2) == 1
        fp8 = dict(ks_ptr=key_scales, vs_ptr=value_scales, stride_sslot=key_scales.stride(0),
                   stride_spos=key_scales.stride(1), KV_FP8=True)  # fmt: skip
    _rope_store_kernel[(rows,)](
        q, k, v, cos, sin, positions, row_slots,
        positions if cache_positions is None else cache_positions, key_cache, value_cache,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), NH=num_heads, NKV=num_kv, HALF=head_dim // 2,
        NH_PAD=triton.next_power_of_2(num_heads), NKV_PAD=triton.next_power_of_2(num_kv),
        K_IN_PLACE=rotate_k, **fp8, **launch.keywords(),
    )  # fmt: skip
