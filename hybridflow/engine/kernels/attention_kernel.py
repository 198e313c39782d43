"""The decode attention Triton kernel: a program per (row, kv head, sequence split) over the
row's live cache length (GQA, split-K flash-decoding), with RoPE, the folded RMSNorm and the
new token's cache store fused in, and the kernel that combines the splits. attention.py
launches them (and autotunes the tile); they share rowwise.py's _rotate.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridflow.engine.fp8.e4m3 import TINY
from hybridflow.engine.kernels.attention_tiles import cache_offsets, softmax_tile
from hybridflow.engine.kernels.fp8_quant import e4m3_values, row_scale
from hybridflow.engine.kernels.pdl import wait_then_release
from hybridflow.engine.kernels.rowwise import _rotate

_TINY = tl.constexpr(TINY)

# -------------------------------------------------------------------------------------------
# Decode attention over each row's live length (GQA, split-K flash-decoding)


@triton.jit
def _decode_attention_kernel(
    q_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, out_ptr,
    part_o_ptr, part_lse_ptr, stride_q, stride_kn, stride_vn, stride_cs, stride_cslot,
    stride_cpos, stride_chead, stride_o, scale_log2, CHUNK, ROWS_BUCKET,
    G: tl.constexpr, G_PAD: tl.constexpr, HALF: tl.constexpr, NH: tl.constexpr,
    SPLITS: tl.constexpr, FP32_DOT: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False, STORE_LAST: tl.constexpr = False,
    h_ptr=None, bias_ptr=None, stride_h=0, H=1, eps=0.0, NORM: tl.constexpr = False,
    H_PAD: tl.constexpr = 16, HAS_BIAS: tl.constexpr = False,
    first_ptr=None, qs_ptr=None, pm_ptr=None, pl_ptr=None, pacc_ptr=None,
    SHARED: tl.constexpr = False, table_ptr=None, stride_table=0, PAGE: tl.constexpr = 0,
    sink_ptr=None, HAS_SINK: tl.constexpr = False,
    ks_ptr=None, vs_ptr=None, stride_sslot=0, stride_spos=0, KV_FP8: tl.constexpr = False,
    shift_ptr=None, ROPE_SHIFT: tl.constexpr = False,
):  # fmt: skip
    """One (row, kv head, split): attention of the head group's queries over cached positions
    [split * CHUNK, (split + 1) * CHUNK) up to the row's last position pos.

    ROPE: q and the new token's k arrive unrotated; both are rotated here, the new k/v are
    stored at cache[slot, pos] (by split 0) and the new token is attended from registers (so
    no program reads the position being written). Without ROPE, position pos is read from the
    cache like the others. Vectors are handled as halves (rotate_half RoPE pairs them).

    ROPE_SHIFT (with ROPE; mRoPE prompts with images, engine/images.py): the new token turns
    at pos + shift[slot], its slot's rotary shift (<= 0), while it is stored and attended at
    its cache position pos. shift lives at a fixed address (RopeTable.slot_shift), so graph
    replays read each slot's current shift.

    STORE_LAST: store the new token's rotated k/v after the loop instead of before it (a
    store ahead of the loop keeps the loop's first loads behind it in the PTX: the compiler
    cannot tell the addresses apart). Tuned with the tile: on the H200 head dim 64 ran
    0.2-2.3% faster with it, head dim 128 (1.5b, 256 rows) 38% slower.

    NORM (with ROPE; lean.py): q/k/v arrive as residual @ W^T with the RMSNorm weight folded
    into W and no bias; this program takes the row's 1/rms from the residual stream h [B, H]
    and forms rstd * x + bias (rounded to the activation dtype, as the matmul's output
    would be) before RoPE.

    SHARED (one split; shared_prefix.py): the row's cached positions start at first[row],
    the end of a prompt prefix its group attends to once (shared_prefix.prefix_attention,
    launched next); instead of the output, this program leaves the rotated q (qs) and its
    unnormalised softmax state (max m, sum l, acc) for that kernel to merge into.

    PAGE (paged cache, kv_cache.py): the cache is [blocks, PAGE, kv heads, D] and the row's
    position p lives in block table[slot, p // PAGE] at p % PAGE (cache_offsets); 0: the
    slot cache, position p of slot `slot`. With PAGE >= BLOCK_N the tiles start at multiples
    of BLOCK_N (the positions before the first to read masked), so each lies in one block
    and takes one table load, as a slot's tile takes its base (with a lookup per position,
    the paged cache measured ~9% below the slot cache at 0.5b, 256 rows, on the H200).

    HAS_SINK (GPT-OSS): each head's learned logit sink[head] joins the softmax denominator
    as a column with no value; split 0 folds it into its running state (once a row), so
    the splits' merge and the shared prefix's see it like any key.

    KV_FP8 (cache/fp8_kv.py): the caches hold e4m3 values and ks/vs a scale per (position,
    kv head) [entries, positions, kv heads]; each tile is dequantized to the activation
    dtype before its dots. The new token's k/v are quantized as they are stored, and
    attended from registers dequantized, as later steps read them back."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Read before the PDL wait (below): slots and positions change only at the end of a step
    # (the sampler) or between graph replays, never in the last two launches (pdl.py).
    slot = tl.load(slot_ptr + row)
    pos = tl.load(pos_ptr + row)
    rope_pos = pos
    if ROPE_SHIFT:  # set at admission, before any step of the slot (images.set_slot_shifts)
        # at least 0: a padding row's stale position must not read before the table
        rope_pos = tl.maximum(pos + tl.load(shift_ptr + slot).to(pos.dtype), 0)
    start = split * CHUNK
    chunk_end = start + CHUNK
    if ROPE:
        end = tl.minimum(chunk_end, pos)  # cached positions; pos itself comes from registers
    else:
        end = tl.minimum(chunk_end, pos + 1)
    base = kv_head * stride_chead
    s_base = kv_head.to(tl.int64)  # the scales' (KV_FP8): heads contiguous
    if not PAGE:
        base += slot.to(tl.int64) * stride_cslot
        s_base += slot.to(tl.int64) * stride_sslot
    wait_then_release(PDL)
    dtype = q_ptr.dtype.element_ty
    g = tl.arange(0, G_PAD)
    h = tl.arange(0, HALF)
    d = tl.arange(0, 2 * HALF)
    heads = kv_head * G + g
    g_mask = g < G
    q_offs = row * stride_q + heads[:, None] * (2 * HALF) + h[None, :]
    q1 = tl.load(q_ptr + q_offs, mask=g_mask[:, None], other=0.0)
    q2 = tl.load(q_ptr + q_offs + HALF, mask=g_mask[:, None], other=0.0)
    if NORM:
        cols = tl.arange(0, H_PAD)
        hrow = tl.load(h_ptr + row * stride_h + cols, mask=cols < H, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hrow * hrow, axis=0) / H + eps)
        q_bias = heads[:, None] * (2 * HALF) + h[None, :]
        q1 = _norm_bias(q1, rstd, bias_ptr, q_bias, g_mask[:, None], HAS_BIAS)
        q2 = _norm_bias(q2, rstd, bias_ptr, q_bias + HALF, g_mask[:, None], HAS_BIAS)
    if ROPE:
        cos = tl.load(cos_ptr + rope_pos * stride_cs + h).to(tl.float32)
        sin = tl.load(sin_ptr + rope_pos * stride_cs + h).to(tl.float32)
        q1, q2 = _rotate(
            q1.to(tl.float32), q2.to(tl.float32), cos[None, :], sin[None, :], dtype
        )  # fmt: skip
        kn_offs = row * stride_kn + kv_head * (2 * HALF) + h
        k1n = tl.load(kn_ptr + kn_offs)
        k2n = tl.load(kn_ptr + kn_offs + HALF)
        v_new = tl.load(vn_ptr + row * stride_vn + kv_head * (2 * HALF) + d)
        if NORM:  # bias layout: q (NH heads), k, v (NH // G heads each)
            k_bias = NH * (2 * HALF) + kv_head * (2 * HALF) + h
            k1n = _norm_bias(k1n, rstd, bias_ptr, k_bias, True, HAS_BIAS)
            k2n = _norm_bias(k2n, rstd, bias_ptr, k_bias + HALF, True, HAS_BIAS)
            v_bias = (NH + NH // G) * (2 * HALF) + kv_head * (2 * HALF) + d
            v_new = _norm_bias(v_new, rstd, bias_ptr, v_bias, True, HAS_BIAS)
        k1n, k2n = _rotate(k1n.to(tl.float32), k2n.to(tl.float32), cos, sin, dtype)
        new_offs = base + cache_offsets(table_ptr, slot, pos, stride_table, stride_cslot,
                                        stride_cpos, PAGE, pos >= 0)  # fmt: skip
        if KV_FP8:
            new_s = s_base + cache_offsets(table_ptr, slot, pos, stride_table, stride_sslot,
                                           stride_spos, PAGE, pos >= 0)  # fmt: skip
            k_amax = tl.maximum(tl.max(tl.abs(k1n.to(tl.float32)), axis=0),
                                tl.max(tl.abs(k2n.to(tl.float32)), axis=0))  # fmt: skip
            k_scale = row_scale(k_amax, _TINY)
            v_scale = row_scale(tl.max(tl.abs(v_new.to(tl.float32)), axis=0), _TINY)
            k1q = e4m3_values(k1n.to(tl.float32), k_scale)
            k2q = e4m3_values(k2n.to(tl.float32), k_scale)
            vq = e4m3_values(v_new.to(tl.float32), v_scale)
            if split == 0:
                tl.store(ks_ptr + new_s, k_scale)
                tl.store(vs_ptr + new_s, v_scale)
            # registers attend with what the cache will read back
            k1n, k2n = (k1q * k_scale).to(dtype), (k2q * k_scale).to(dtype)
            v_new = (vq * v_scale).to(dtype)
            k1n_stored = k1q.to(kc_ptr.dtype.element_ty)
            k2n_stored = k2q.to(kc_ptr.dtype.element_ty)
            v_stored = vq.to(vc_ptr.dtype.element_ty)
        else:
            k1n_stored, k2n_stored, v_stored = k1n, k2n, v_new
        if not STORE_LAST:
            _store_new_kv(kc_ptr, vc_ptr, new_offs, split, k1n_stored, k2n_stored, v_stored, h,
                          d, HALF)  # fmt: skip
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, 2 * HALF], tl.float32)
    # the halves back into one [G_PAD, D] row block (one dot per tile; K = D >= 16)
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (G_PAD, 2 * HALF))
    loop_start = start
    if SHARED:  # positions before first[row] are the group's shared prefix
        loop_start = tl.maximum(start, tl.load(first_ptr + row).to(tl.int32))
    first_read = loop_start
    if PAGE >= BLOCK_N:  # tiles aligned to BLOCK_N lie in one block: one table load a tile
        # (none when nothing is to be read: a fully masked tile would make the softmax NaN)
        loop_start = tl.where(first_read < end, first_read - first_read % BLOCK_N, end)
    for n0 in range(loop_start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        if PAGE >= BLOCK_N:
            n_mask = (n >= first_read) & (n < end)
            block = tl.load(table_ptr + slot.to(tl.int64) * stride_table + n0 // PAGE)
            at = block.to(tl.int64) * stride_cslot + (n % PAGE).to(tl.int64) * stride_cpos
            s_at = block.to(tl.int64) * stride_sslot + (n % PAGE).to(tl.int64) * stride_spos
        else:
            n_mask = n < end
            at = cache_offsets(table_ptr, slot, n, stride_table, stride_cslot, stride_cpos,
                                 PAGE, n_mask)  # fmt: skip
            s_at = n  # only read under KV_FP8, which the wrapper runs paged
            if KV_FP8:
                s_at = cache_offsets(table_ptr, slot, n, stride_table, stride_sslot,
                                     stride_spos, PAGE, n_mask)  # fmt: skip
        offs = base + at[:, None] + d[None, :]
        k = tl.load(kc_ptr + offs, mask=n_mask[:, None], other=0.0)
        v = tl.load(vc_ptr + offs, mask=n_mask[:, None], other=0.0)
        if KV_FP8:
            k_scales = tl.load(ks_ptr + s_base + s_at, mask=n_mask, other=0.0)
            v_scales = tl.load(vs_ptr + s_base + s_at, mask=n_mask, other=0.0)
            k = (k.to(tl.float32) * k_scales[:, None]).to(dtype)
            v = (v.to(tl.float32) * v_scales[:, None]).to(dtype)
        m_i, l_i, acc = softmax_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, scale_log2, FP32_DOT)
    if ROPE:
        if STORE_LAST:  # no program reads position pos from the cache: it may come last
            _store_new_kv(kc_ptr, vc_ptr, new_offs, split, k1n_stored, k2n_stored, v_stored, h,
                          d, HALF)  # fmt: skip
        if (start <= pos) & (pos < chunk_end):  # the new token belongs to this split
            s_new = tl.sum(q1.to(tl.float32) * k1n.to(tl.float32)[None, :], axis=1)
            s_new += tl.sum(q2.to(tl.float32) * k2n.to(tl.float32)[None, :], axis=1)
            s_new = s_new * scale_log2
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            if not FP32_DOT:  # the PV dot rounds P to the value dtype
                p_new = p_new.to(dtype).to(tl.float32)
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new
    if HAS_SINK:
        if split == 0:
            s_sink = tl.load(sink_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
            s_sink = s_sink * 1.4426950408889634  # log2 units, as the scores
            m_new = tl.maximum(m_i, s_sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(s_sink - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new
    out_dtype = out_ptr.dtype.element_ty
    if SHARED:
        state = row * NH + heads  # [G_PAD]
        tl.store(qs_ptr + state[:, None] * (2 * HALF) + d[None, :], q, mask=g_mask[:, None])
        tl.store(pm_ptr + state, m_i, mask=g_mask)
        tl.store(pl_ptr + state, l_i, mask=g_mask)
        tl.store(pacc_ptr + state[:, None] * (2 * HALF) + d[None, :], acc, mask=g_mask[:, None])
    elif SPLITS == 1:
        out = acc / l_i[:, None]
        o_offs = row * stride_o + heads[:, None] * (2 * HALF) + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_dtype), mask=g_mask[:, None])
    else:
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        out = acc / safe_l[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))  # log2 units
        part = (row * NH + heads) * SPLITS + split  # [G_PAD]
        tl.store(part_o_ptr + part[:, None] * (2 * HALF) + d[None, :], out, mask=g_mask[:, None])
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _norm_bias(x, rstd, bias_ptr, offs, mask, HAS_BIAS: tl.constexpr):
    """rstd * x (+ bias[offs]) in fp32, rounded to x's dtype."""
    y = x.to(tl.float32) * rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return y.to(x.dtype)


@triton.jit
def _store_new_kv(kc_ptr, vc_ptr, new_offs, split, k1n, k2n, v_new, h, d, HALF: tl.constexpr):
    """The new token's rotated k (two halves) and v at element offset new_offs (its cache
    position and kv head; split 0 only)."""
    if split == 0:
        tl.store(kc_ptr + new_offs + h, k1n)
        tl.store(kc_ptr + new_offs + HALF + h, k2n)
        tl.store(vc_ptr + new_offs + d, v_new)


@triton.jit
def _combine_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_o, NH: tl.constexpr, D: tl.constexpr,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_then_release(PDL)
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
