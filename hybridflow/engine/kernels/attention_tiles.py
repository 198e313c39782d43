"""The pieces of flash attention that both decode kernels (attention.py's per row,
shared_prefix.py's per prompt prefix) run: where a position's K/V lives in the cache, asking
L2 for them ahead, and one tile of the online softmax."""

from __future__ import annotations

import triton
import triton.language as tl

from hybridflow.engine.kernels.pdl import prefetch_l2


@triton.jit
def cache_offsets(table_ptr, slot, n, stride_table, stride_cslot, stride_cpos,
                  PAGE: tl.constexpr, mask):  # fmt: skip
    """Element offsets of positions n (a scalar or a vector; `mask`: the valid ones) of
    sequence `slot`, without the kv head's: in a paged cache (PAGE = the block size) through
    the block table, else within the slot (whose offset the caller adds)."""
    n = n.to(tl.int64)
    if PAGE:
        block = tl.load(table_ptr + slot.to(tl.int64) * stride_table + n // PAGE, mask=mask,
                        other=0)  # fmt: skip
        return block.to(tl.int64) * stride_cslot + (n % PAGE) * stride_cpos
    return n * stride_cpos


@triton.jit
def prefetch_kv(kc_ptr, vc_ptr, base, lines, lo, hi, stride_cpos):
    """Ask L2 for the cached keys and values of positions [lo, hi) at base (a slot and kv
    head), `lines` the element offsets of a position's 128-byte lines (pdl.py; the
    shared-prefix kernel's prefixes before its PDL wait)."""
    for p0 in range(lo, hi, 64):
        p = tl.minimum(p0 + tl.arange(0, 64), hi - 1).to(tl.int64)
        offs = base + p[:, None] * stride_cpos + lines[None, :]
        prefetch_l2(kc_ptr + offs)
        prefetch_l2(vc_ptr + offs)


@triton.jit
def softmax_tile(q, k, v, mask, m_i, l_i, acc, scale_log2, FP32_DOT: tl.constexpr):
    """One tile of flash attention's online softmax, in log2 units: queries q [M, D] over
    keys/values k, v [N, D] (mask [M, N] or [1, N]: the pairs that attend) update the
    running max m_i [M], sum l_i [M] and unnormalised output acc [M, D]. The PV product rounds P to the values'
    dtype, as torch's attention does. Shared by the decode kernels (row and prefix) and the
    mixed step's chunk kernel (a causal mask a row)."""
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(mask, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv
