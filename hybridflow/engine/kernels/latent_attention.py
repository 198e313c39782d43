"""MLA's absorbed decode attention in one Triton kernel, over the latent cache in place
(cache/latent.py; CUDA, or the CPU under TRITON_INTERPRET=1 in tests).

Per row b (one query token) and a tile of BLOCK_H heads, with s = the row's slot:

    score[h, t] = (q_latent[b, h] . c[s, t] + q_rope[b, h] . k_rope[s, t]) * scale
    out[b, h]   = sum_t softmax_t(score[h])[t] c[s, t]                        [r]

over positions t < lengths[b], walked in tiles of BLOCK_N with an online softmax (fp32).
Position t of slot s is entry block_table[s, t // B] at offset t % B of a paged cache, or
entry s at offset t of a slot cache. Every head of a tile shares each latent tile it loads
(MLA's one latent a token for all heads: that is what keeps the read at r + rope values a
token). The grid and loop bounds come from the device (the rows' lengths), so the launch
replays under CUDA graphs. W_UK (into q_latent) and W_UV (on the output) stay torch matmuls
around it: layers/latent.py; the torch reference is mla_absorbed.absorbed_attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _latent_decode_kernel(
    q_ptr, qr_ptr, cache_ptr, table_ptr, slots_ptr, lengths_ptr, out_ptr,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_ce, stride_cp, stride_t, stride_ob,
    stride_oh, heads, scale,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = h < heads
    r = tl.arange(0, BLOCK_R)
    mask_r = r < RANK
    p = tl.arange(0, BLOCK_P)
    mask_p = p < ROPE
    dtype = cache_ptr.dtype.element_ty
    q = tl.load(q_ptr + row * stride_qb + h[:, None] * stride_qh + r[None, :],
                mask=mask_h[:, None] & mask_r[None, :], other=0.0).to(dtype)  # fmt: skip
    qr = tl.load(qr_ptr + row * stride_rb + h[:, None] * stride_rh + p[None, :],
                 mask=mask_h[:, None] & mask_p[None, :], other=0.0).to(dtype)  # fmt: skip
    slot = tl.load(slots_ptr + row).to(tl.int64)
    length = tl.load(lengths_ptr + row)
    best = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    for start in range(0, length, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        mask_t = t < length
        if PAGED:
            entry = tl.load(table_ptr + slot * stride_t + t // BLOCK_SIZE, mask=mask_t, other=0)
            base = entry.to(tl.int64) * stride_ce + (t % BLOCK_SIZE) * stride_cp
        else:
            base = slot * stride_ce + t.to(tl.int64) * stride_cp
        c = tl.load(cache_ptr + base[:, None] + r[None, :],
                    mask=mask_t[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
        kr = tl.load(cache_ptr + base[:, None] + RANK + p[None, :],
                     mask=mask_t[:, None] & mask_p[None, :], other=0.0)  # fmt: skip
        if FP32_DOT:
            scores = tl.dot(q, tl.trans(c), input_precision="ieee")
            scores += tl.dot(qr, tl.trans(kr), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(c)) + tl.dot(qr, tl.trans(kr))
        scores = tl.where(mask_t[None, :], scores * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        correction = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * correction + tl.sum(weights, axis=1)
        if FP32_DOT:
            acc = acc * correction[:, None] + tl.dot(weights, c, input_precision="ieee")
        else:  # the weights rounded to the latent's dtype, as torch's attention rounds P
            acc = acc * correction[:, None] + tl.dot(weights.to(dtype), c)
        best = new_best
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a row that sees nothing: zeros
    tl.store(out_ptr + row * stride_ob + h[:, None] * stride_oh + r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_r[None, :])  # fmt: skip


def latent_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latents: torch.Tensor,
    row_slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    rank: int,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_latent [B, nh, r] (W_UK folded in), q_rope [B, nh, rope] (turned), latents one
    layer's cache [entries, positions, r + rope], row_slots [B], lengths [B] (positions each
    row attends to), block_table: a paged cache's (None: entries are slots) -> the output in
    the latent space [B, nh, r] fp32."""
    rows, heads, _ = q_latent.shape
    rope = latents.shape[-1] - rank
    assert latents.stride(-1) == 1 and q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1
    out = torch.empty(rows, heads, rank, dtype=torch.float32, device=q_latent.device)
    if rows == 0:
        return out
    paged = block_table is not None
    table = block_table if paged else row_slots  # unread by a slot cache's kernel
    block_h = 16  # tl.dot's smallest tile; more heads a tile would hold [BLOCK_H, r] in fp32
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = 16 if block_r >= 256 else 32  # the latent tile [BLOCK_N, r] stays in registers
    _latent_decode_kernel[(rows, triton.cdiv(heads, block_h))](
        q_latent, q_rope, latents, table, row_slots, lengths, out,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        latents.stride(0), latents.stride(1), table.stride(0) if paged else 0, out.stride(0),
        out.stride(1), heads, scale,
        RANK=rank, ROPE=rope, BLOCK_SIZE=latents.shape[1], PAGED=paged, BLOCK_H=block_h,
        BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        FP32_DOT=latents.dtype == torch.float32, num_warps=8 if block_r >= 256 else 4,
    )  # fmt: skip
    return out
