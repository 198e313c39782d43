"""An MLA layer's decode rows between its projections and the absorbed attention, in one
launch (layers/latent.py's Triton step): q's rope part turned in place, the latent normed,
the shared rope key turned, and both written to the latent cache at each row's position.

The model's modules (models/mixers/mla.py) take ~20 launches for the same: the rope of q and
of k_rope as slices, products, differences and concatenations each, the latent's RMSNorm,
then the concatenation and the indexed store. Each rope step is rounded to the activation
dtype where those torch ops round it (each product, then the sum); the RMSNorm in fp32, as
kernels/rowwise.py's (the model's F.rms_norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _turn(first, second, c1, s1, c2, s2, dtype: tl.constexpr):
    """(first * c1 - second * s1, second * c2 + first * s2), each product and the sum rounded
    to dtype, in fp32."""
    low = (first * c1).to(dtype).to(tl.float32) - (second * s1).to(dtype).to(tl.float32)
    high = (second * c2).to(dtype).to(tl.float32) + (first * s2).to(dtype).to(tl.float32)
    return low.to(dtype).to(tl.float32), high.to(dtype).to(tl.float32)


@triton.jit
def _latent_rope_store_kernel(
    q_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, latent_ptr, entry_ptr, offset_ptr, heads,
    stride_qb, stride_qh, stride_kv, stride_cos, stride_le, stride_lo, eps,
    NOPE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, RANK: tl.constexpr,
    RANK_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """One row a program. A rope part of D = 2 * HALF values is turned as pairs (j, j + HALF)
    of cos/sin [.., D] (rope.apply_rope), or, INTERLEAVED, as pairs (2j, 2j + 1) by frequency
    j (mla.apply_rope_interleaved); either way the result holds the pairs' first members'
    values in [0, HALF) and the second members' in [HALF, D)."""
    row = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    if INTERLEAVED:
        first, second, second_freq = 2 * j, 2 * j + 1, j
    else:
        first, second, second_freq = j, HALF + j, HALF + j
    trig = row * stride_cos
    c1 = tl.load(cos_ptr + trig + j, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + trig + j, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + trig + second_freq, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + trig + second_freq, mask=jm, other=0.0).to(tl.float32)
    # q's rope part of every head, in place (loaded whole before any store)
    h = tl.arange(0, HEADS_PAD)
    qm = (h < heads)[:, None] & jm[None, :]
    q = q_ptr + row * stride_qb + h[:, None].to(tl.int64) * stride_qh + NOPE
    qa = tl.load(q + first[None, :], mask=qm, other=0.0).to(tl.float32)
    qb = tl.load(q + second[None, :], mask=qm, other=0.0).to(tl.float32)
    low, high = _turn(qa, qb, c1[None, :], s1[None, :], c2[None, :], s2[None, :], dtype)
    tl.store(q + j[None, :], low.to(dtype), mask=qm)
    tl.store(q + HALF + j[None, :], high.to(dtype), mask=qm)
    # the latent's RMSNorm and the rope key, to the cache at the row's entry and offset
    kv = kv_ptr + row * stride_kv
    r = tl.arange(0, RANK_PAD)
    rm = r < RANK
    x = tl.load(kv + r, mask=rm, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / RANK + eps)
    normed = normed * tl.load(w_ptr + r, mask=rm, other=0.0).to(tl.float32)
    ka = tl.load(kv + RANK + first, mask=jm, other=0.0).to(tl.float32)
    kb = tl.load(kv + RANK + second, mask=jm, other=0.0).to(tl.float32)
    k_low, k_high = _turn(ka, kb, c1, s1, c2, s2, dtype)
    entry = tl.load(entry_ptr + row).to(tl.int64)
    offset = tl.load(offset_ptr + row).to(tl.int64)
    out = latent_ptr + entry * stride_le + offset * stride_lo
    out_dtype = latent_ptr.dtype.element_ty
    tl.store(out + r, normed.to(dtype).to(out_dtype), mask=rm)
    tl.store(out + RANK + j, k_low.to(out_dtype), mask=jm)
    tl.store(out + RANK + HALF + j, k_high.to(out_dtype), mask=jm)


def latent_rope_store(q: torch.Tensor, kv: torch.Tensor, norm, cos: torch.Tensor,
                      sin: torch.Tensor, latent: torch.Tensor, entries: torch.Tensor,
                      offsets: torch.Tensor, nope: int, interleaved: bool) -> None:  # fmt: skip
    """q [B, nh, nope + rope] (q's projection; its rope part turned in place), kv [B, r +
    rope] (kv_a's output: the latent, then the rope key), norm: the latent's RMSNorm module,
    cos/sin [B, rope]; latent [entries, positions, r + rope] (one layer's cache) gets each
    row's normed latent and turned rope key at (entries[b], offsets[b])."""
    rows, heads, width = q.shape
    rope = width - nope
    rank = kv.shape[1] - rope
    assert q.stride(2) == 1 and kv.stride(1) == 1 and cos.stride(1) == 1 and rope % 2 == 0
    assert latent.stride(2) == 1 and sin.stride() == cos.stride()
    if not rows:
        return
    half = rope // 2
    _latent_rope_store_kernel[(rows,)](
        q, kv, norm.weight, cos, sin, latent, entries, offsets, heads, q.stride(0), q.stride(1),
        kv.stride(0), cos.stride(0), latent.stride(0), latent.stride(1), float(norm.eps),
        NOPE=nope, HALF=half, HALF_PAD=triton.next_power_of_2(half), RANK=rank,
        RANK_PAD=triton.next_power_of_2(rank), HEADS_PAD=triton.next_power_of_2(heads),
        INTERLEAVED=interleaved, num_warps=4,
    )  # fmt: skip
