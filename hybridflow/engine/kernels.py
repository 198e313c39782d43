"""Fused Triton kernels for the decode step (CUDA; run on CPU under TRITON_INTERPRET=1 in tests).

Why: at decode batch sizes every op is memory- or launch-bound, and an eager step of a 24-layer
model is ~40 tiny kernels per layer. Fusing RMSNorm with the residual add, RoPE with the cache
store, SiLU with the up projection, and the whole sampler into one pass over the logits cuts
that to ~11 per layer (the rest are cuBLAS matmuls). Attention reads only each row's live
length, split across thread blocks when the batch is small (flash-decoding).

Rounding follows the torch ops they replace (results cast to the activation dtype where torch
would), so bf16 outputs stay within a rounding step of the eager path.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from hybridflow.engine import sampling
from hybridflow.engine.sampling import SamplingParams

# The hash constants of sampling.py, as constants a Triton kernel may read.
MIX_C1 = tl.constexpr(sampling._MIX_C1)
MIX_C2 = tl.constexpr(sampling._MIX_C2)
STEP_SALT = tl.constexpr(sampling._STEP_SALT)
SEED_SALT = tl.constexpr(sampling._SEED_SALT)
GOLDEN = tl.constexpr(sampling._GOLDEN)
LN2 = tl.constexpr(0.6931471805599453)

# Autotune the attention kernel's tile (CUDA only); off gives a fixed tile (for A/B runs).
AUTOTUNE = True

# -------------------------------------------------------------------------------------------
# RMSNorm, residual add + RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_o, H, eps,
    ADD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * tl.rsqrt(variance + eps) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """x [B, H] -> RMSNorm(x) * norm.weight [B, H] (norm: the model's RMSNorm module)."""
    out = torch.empty_like(x)
    rows, hidden = x.shape
    _rms_norm_kernel[(rows,)](
        x, x, norm.weight, out, x.stride(0), x.stride(0), out.stride(0), hidden, norm.eps,
        ADD=False, BLOCK_H=triton.next_power_of_2(hidden),
    )  # fmt: skip
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, norm) -> torch.Tensor:
    """residual += delta (in place, [B, H]); returns RMSNorm(residual) * norm.weight."""
    out = torch.empty_like(residual)
    rows, hidden = residual.shape
    _rms_norm_kernel[(rows,)](
        residual, delta, norm.weight, out, residual.stride(0), delta.stride(0), out.stride(0),
        hidden, norm.eps, ADD=True, BLOCK_H=triton.next_power_of_2(hidden),
    )  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------
# SiLU(gate) * up


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch rounds silu(g) first
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(dtype), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, both [B, I] with contiguous rows (may be halves of one [B, 2I])."""
    rows, inner = gate.shape
    out = torch.empty(rows, inner, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inner, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), inner, BLOCK=block
    )
    return out


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
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
    stride_q, stride_k, stride_v, stride_cs, stride_cslot, stride_cpos,
    NH: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr,
    NH_PAD: tl.constexpr, NKV_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    pos = tl.load(pos_ptr + row)
    slot = tl.load(slot_ptr + row)
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
    # k rotated, k and v into cache[slot, pos]
    kv_heads = tl.arange(0, NKV_PAD)[:, None]
    kv_mask = kv_heads < NKV
    kv_offs = kv_heads * (2 * HALF) + half[None, :]
    k1 = tl.load(k_ptr + row * stride_k + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + row * stride_k + kv_offs + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    r1, r2 = _rotate(k1, k2, c, s, dtype)
    cache_offs = slot * stride_cslot + pos * stride_cpos + kv_offs
    tl.store(kc_ptr + cache_offs, r1, mask=kv_mask)
    tl.store(kc_ptr + cache_offs + HALF, r2, mask=kv_mask)
    v1 = tl.load(v_ptr + row * stride_v + kv_offs, mask=kv_mask, other=0.0)
    v2 = tl.load(v_ptr + row * stride_v + kv_offs + HALF, mask=kv_mask, other=0.0)
    tl.store(vc_ptr + cache_offs, v1, mask=kv_mask)
    tl.store(vc_ptr + cache_offs + HALF, v2, mask=kv_mask)


def rope_store(q, k, v, cos, sin, positions, row_slots, key_cache, value_cache) -> None:
    """q [B, nh, D] rotated in place; rotated k [B, nkv, D] and v stored at
    cache[row_slots, positions] (key_cache/value_cache: one layer, [slots, S, nkv, D]).
    q/k/v rows may be strided (views of matmul outputs); heads and dims contiguous."""
    rows, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == head_dim and k.stride(1) == head_dim
    _rope_store_kernel[(rows,)](
        q, k, v, cos, sin, positions, row_slots, key_cache, value_cache,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), key_cache.stride(0),
        key_cache.stride(1), NH=num_heads, NKV=num_kv, HALF=head_dim // 2,
        NH_PAD=triton.next_power_of_2(num_heads), NKV_PAD=triton.next_power_of_2(num_kv),
    )  # fmt: skip


# -------------------------------------------------------------------------------------------
# Decode attention over each row's live length (GQA, split-K flash-decoding)


@triton.jit
def _decode_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, slot_ptr, len_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    stride_q, stride_cslot, stride_cpos, stride_o, scale_log2, CHUNK,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, NH: tl.constexpr,
    SPLITS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + row)
    length = tl.load(len_ptr + row)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, length)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kv_head * G + g
    g_mask = g < G
    q = tl.load(q_ptr + row * stride_q + heads[:, None] * D + d[None, :], mask=g_mask[:, None])
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    base = slot.to(tl.int64) * stride_cslot + kv_head * D
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        offs = base + n[:, None].to(tl.int64) * stride_cpos + d[None, :]
        k = tl.load(kc_ptr + offs, mask=n_mask[:, None], other=0.0)
        v = tl.load(vc_ptr + offs, mask=n_mask[:, None], other=0.0)
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))  # [G_PAD, BLOCK_N], log2
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out_dtype = out_ptr.dtype.element_ty
    if SPLITS == 1:
        out = acc / l_i[:, None]
        o_offs = row * stride_o + heads[:, None] * D + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_dtype), mask=g_mask[:, None])
    else:
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        out = acc / safe_l[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))  # log2 units
        part = (row * NH + heads) * SPLITS + split  # [G_PAD]
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], out, mask=g_mask[:, None])
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _combine_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_o, NH: tl.constexpr, D: tl.constexpr,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    part = (row * NH + head) * SPLITS + sp
    sp_mask = sp < SPLITS
    lse = tl.load(part_lse_ptr + part, mask=sp_mask, other=float("-inf"))
    o = tl.load(part_o_ptr + part[:, None] * D + d[None, :], mask=sp_mask[:, None], other=0.0)
    w = tl.exp2(lse - tl.max(lse, axis=0))
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + row * stride_o + head * D + d, out.to(out_ptr.dtype.element_ty))


# Tried on the first call of each shape (outside graph capture; the kernel only writes its
# outputs, so re-running it while tuning is harmless). Interpreter runs use the first config.
_ATTENTION_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
    for bn, w, st in [(64, 4, 2), (32, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 3), (128, 8, 3)]
]
_decode_attention_tuned = triton.autotune(_ATTENTION_CONFIGS, key=["G", "D", "SPLITS", "FP32_DOT"])(
    _decode_attention_kernel
)


def attention_splits(rows: int, num_kv_heads: int, max_len: int) -> int:
    """Sequence splits per (row, kv head): enough thread blocks to fill ~2 waves of 132 SMs,
    but at least 256 positions per split."""
    programs = rows * num_kv_heads
    splits = max(1, math.ceil(264 / programs))
    return max(1, min(splits, max_len // 256, 16))


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    row_slots: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    splits: int | None = None,
) -> torch.Tensor:
    """q [B, nh, D] (rows may be strided), caches [slots, S, nkv, D], lengths [B] -> out
    [B, nh, D]: row b attends over positions [0, lengths[b]) of slot row_slots[b]. max_len is
    a static bound on lengths (it only sizes the splits)."""
    rows, num_heads, head_dim = q.shape
    num_kv = key_cache.shape[2]
    group = num_heads // num_kv
    if splits is None:
        splits = attention_splits(rows, num_kv, max_len)
    chunk = triton.cdiv(max_len, splits)
    out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        part_o = torch.empty(rows, num_heads, splits, head_dim, device=q.device)
        part_lse = torch.empty(rows, num_heads, splits, device=q.device)
    else:
        part_o = part_lse = out
    scale_log2 = (1.0 / math.sqrt(head_dim)) * 1.4426950408889634
    args = (
        q, key_cache, value_cache, row_slots, lengths, out, part_o, part_lse,
        q.stride(0), key_cache.stride(0), key_cache.stride(1), out.stride(0), scale_log2, chunk,
    )  # fmt: skip
    meta = dict(
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, NH=num_heads,
        SPLITS=splits, FP32_DOT=q.dtype == torch.float32,
    )  # fmt: skip
    grid = (rows, num_kv, splits)
    if q.is_cuda and AUTOTUNE:
        _decode_attention_tuned[grid](*args, **meta)
    else:
        _decode_attention_kernel[grid](*args, **meta, BLOCK_N=64 if head_dim <= 64 else 32)
    if splits > 1:
        _combine_splits_kernel[(rows, num_heads)](
            part_o, part_lse, out, out.stride(0), NH=num_heads, D=head_dim, SPLITS=splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        )  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------
# Fused sampler: vocabulary split over programs, one pass over the logits (two with min-p),
# no fp32 [B, V] copy


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], MIX_C1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], MIX_C2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _log2(x, FAST_MATH: tl.constexpr):
    if FAST_MATH:  # lg2.approx: the noise needs no last-bit accuracy
        return tl.extra.cuda.libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _sample_split_kernel(
    logits_ptr, stride_l, V, seed_lo_ptr, seed_hi_ptr, step_ptr, threshold_ptr,
    part_m_ptr, part_s_ptr, part_score_ptr, part_idx_ptr, part_z_ptr, inv_temperature,
    log_min_p, MAX_ONLY: tl.constexpr, GREEDY: tl.constexpr, SCALE: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr, HAS_MIN_P: tl.constexpr, SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, SPLIT_SIZE: tl.constexpr, BLOCK_V: tl.constexpr,
    FAST_MATH: tl.constexpr,
):  # fmt: skip
    """One (row, vocab split): running max/sum-exp of z = logits / T and the best Gumbel score
    over allowed tokens. MAX_ONLY: just the split max (min-p needs the row max first)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_l
    part = row * SPLITS + split
    offs = tl.arange(0, BLOCK_V)
    lo = split * SPLIT_SIZE
    if MAX_ONLY:
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        for v0 in range(lo, lo + SPLIT_SIZE, BLOCK_V):
            idx = v0 + offs
            z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            if SCALE:
                z = z * inv_temperature
            m = tl.maximum(m, z)
        tl.store(part_m_ptr + part, tl.max(m, axis=0))
        return
    threshold = float("-inf")
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    if HAS_MIN_P:
        sp = tl.arange(0, SPLITS_PAD)
        maxima = tl.load(part_m_ptr + row * SPLITS + sp, mask=sp < SPLITS, other=float("-inf"))
        threshold = tl.maximum(threshold, tl.max(maxima, axis=0) + log_min_p)
    if not GREEDY:
        step = tl.load(step_ptr + row).to(tl.uint32)
        seed_lo = tl.load(seed_lo_ptr + row).to(tl.uint32)
        seed_hi = tl.load(seed_hi_ptr + row).to(tl.uint32)
        key = _mix32(step ^ tl.full([], STEP_SALT, tl.uint32))
        key = _mix32(key ^ seed_lo)
        key = _mix32(key ^ seed_hi ^ tl.full([], SEED_SALT, tl.uint32))
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    best_score = float("-inf")
    best_idx = 0
    best_z = 0.0
    for v0 in range(lo, lo + SPLIT_SIZE, BLOCK_V):
        idx = v0 + offs
        z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        if SCALE:
            z = z * inv_temperature
        m_new = tl.maximum(m, z)
        s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(
            z == float("-inf"), 0.0, tl.exp(z - m_new)
        )
        m = m_new
        if GREEDY:
            score = z
        else:
            token_mix = idx.to(tl.uint32) * tl.full([], GOLDEN, tl.uint32)
            bits = _mix32(key ^ token_mix)
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            gumbel = -LN2 * _log2(-_log2(u, FAST_MATH), FAST_MATH)  # + ln(ln 2): argmax-neutral
            score = tl.where(z >= threshold, z + gumbel, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0)
        if block_best > best_score:
            best_score = block_best
            best_idx = v0 + block_idx
            best_z = tl.sum(tl.where(offs == block_idx, z, 0.0), axis=0)
    m_split = tl.max(m, axis=0)
    s_split = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_split)), axis=0)
    tl.store(part_m_ptr + part, m_split)
    tl.store(part_s_ptr + part, s_split)
    tl.store(part_score_ptr + part, best_score)
    tl.store(part_idx_ptr + part, best_idx)
    tl.store(part_z_ptr + part, best_z)


@triton.jit
def _sample_combine_kernel(
    part_m_ptr, part_s_ptr, part_score_ptr, part_idx_ptr, part_z_ptr, tok_ptr, logprob_ptr,
    finished_ptr, slot_ptr, generated_ptr, max_new_ptr, stop_mask_ptr, state_tok_ptr,
    positions_ptr, out_tok_ptr, out_lp_ptr, stride_out,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, ADVANCE: tl.constexpr,
):  # fmt: skip
    """Per row: the winning split's token, log-prob = z - logsumexp; with ADVANCE, also the
    decode-state update of state.advance (record, count, stop, move) in the same launch."""
    row = tl.program_id(0)
    sp = tl.arange(0, SPLITS_PAD)
    mask = sp < SPLITS
    parts = row * SPLITS + sp
    m = tl.load(part_m_ptr + parts, mask=mask, other=float("-inf"))
    s = tl.load(part_s_ptr + parts, mask=mask, other=0.0)
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(tl.where(mask, s * tl.exp(m - m_row), 0.0), axis=0))
    score = tl.load(part_score_ptr + parts, mask=mask, other=float("-inf"))
    best = tl.argmax(score, axis=0)  # first split on ties = lowest token id, like torch.argmax
    token = tl.sum(tl.where(sp == best, tl.load(part_idx_ptr + parts, mask=mask, other=0), 0))
    token = token.to(tl.int64)
    z = tl.sum(tl.where(sp == best, tl.load(part_z_ptr + parts, mask=mask, other=0.0), 0.0))
    logprob = z - lse
    if ADVANCE:
        finished = tl.load(finished_ptr + row).to(tl.int32)
        live = 1 - finished
        slot = tl.load(slot_ptr + row)
        column = tl.load(generated_ptr + row)
        tl.store(out_tok_ptr + slot * stride_out + column, token)
        tl.store(out_lp_ptr + slot * stride_out + column, logprob)
        generated = column + live
        stop = tl.load(stop_mask_ptr + token).to(tl.int32)
        stop = stop | (generated >= tl.load(max_new_ptr + row)).to(tl.int32)
        tl.store(finished_ptr + row, (finished | stop).to(finished_ptr.dtype.element_ty))
        old_token = tl.load(state_tok_ptr + row)
        tl.store(state_tok_ptr + row, tl.where(live == 1, token, old_token))
        tl.store(positions_ptr + row, tl.load(positions_ptr + row) + live)
        tl.store(generated_ptr + row, generated)
    else:
        tl.store(tok_ptr + row, token)
        tl.store(logprob_ptr + row, logprob)


def sample_fused(
    logits: torch.Tensor,
    params: SamplingParams,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    steps: torch.Tensor,
    block_v: int = 2048,
    target_splits: int = 16,
    state=None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Same contract and noise as sampling.sample_reference (top-p excepted: not fused).

    The vocabulary is split over `target_splits` programs per row (one program per row left
    most SMs idle: measured 234 us at 256 x 152k on an H200), then combined per row.
    With `state` (a DecodeState whose first rows these are), the combine kernel also applies
    state.advance and nothing is returned."""
    rows, vocab = logits.shape
    device = logits.device
    split_size = triton.cdiv(triton.cdiv(vocab, target_splits), block_v) * block_v
    splits = triton.cdiv(vocab, split_size)
    part_m, part_s, part_score, part_z = (
        torch.empty(rows, splits, dtype=torch.float32, device=device) for _ in range(4)
    )
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=device)
    greedy = params.greedy
    temperature = 1.0 if greedy else float(params.temperature)
    has_threshold = not greedy and 0 < params.top_k < vocab
    threshold = part_m  # placeholder pointer when unused
    if has_threshold:
        threshold = torch.topk(logits, params.top_k, dim=-1).values[:, -1].float() / temperature
    has_min_p = not greedy and params.min_p > 0
    common = dict(
        GREEDY=greedy, SCALE=temperature != 1.0, HAS_THRESHOLD=has_threshold,
        HAS_MIN_P=has_min_p, SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        SPLIT_SIZE=split_size, BLOCK_V=block_v, FAST_MATH=logits.is_cuda, num_warps=4,
    )  # fmt: skip
    args = (
        logits, logits.stride(0), vocab, seed_lo, seed_hi, steps, threshold, part_m, part_s,
        part_score, part_idx, part_z, 1.0 / temperature,
        math.log(params.min_p) if has_min_p else 0.0,
    )  # fmt: skip
    if has_min_p:
        _sample_split_kernel[(rows, splits)](*args, MAX_ONLY=True, **common)
    _sample_split_kernel[(rows, splits)](*args, MAX_ONLY=False, **common)
    if state is None:
        tokens = torch.empty(rows, dtype=torch.int64, device=device)
        logprobs = torch.empty(rows, dtype=torch.float32, device=device)
        st = SimpleNamespace(
            finished=tokens, row_slots=tokens, generated=tokens, max_new=tokens,
            stop_mask=tokens, tokens=tokens, positions=tokens, out_tokens=tokens,
            out_logprobs=logprobs,
        )  # fmt: skip
        stride_out = 0
    else:
        tokens = logprobs = part_m  # unused pointers
        st, stride_out = state, state.out_tokens.stride(0)
    _sample_combine_kernel[(rows,)](
        part_m, part_s, part_score, part_idx, part_z, tokens, logprobs, st.finished,
        st.row_slots, st.generated, st.max_new, st.stop_mask, st.tokens, st.positions,
        st.out_tokens, st.out_logprobs, stride_out, SPLITS=splits,
        SPLITS_PAD=common["SPLITS_PAD"], ADVANCE=state is not None,
    )  # fmt: skip
    return None if state is not None else (tokens, logprobs)
