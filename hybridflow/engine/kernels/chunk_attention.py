"""Paged varlen attention for the prompt chunks of a mixed step (scheduling/static_mixed.py):
each chunk's new tokens attend causally over their sequence's cache, the cached prefix and
the chunk itself (stored by rope_store just before), read in place through the block table.
Nothing of a variable size is gathered or allocated, so the step's shapes stay static and it
replays as a CUDA graph (the eager extend pass gathers each sequence's K/V for
FlashAttention's varlen kernel instead, sized by the data).

The work is cut on the host into tiles of up to `tile_tokens` consecutive tokens of one
chunk (chunk_tiles; fewer is fine: the rows past a tile's end are masked): a program per (tile, kv head) attends the tile's tokens x the head
group's query heads as one [tokens * G_PAD, D] matrix, so each K/V tile is read once for the
whole group, over the keys up to the tile's last position. A tile without a sequence (slot
< 0) writes zeros: the padding tokens of the step's budget, whose rows run through the rest
of the layer and are never read. Over an FP8 KV cache (cache/fp8_kv.py) each K/V tile is
dequantized with its scales in registers, as the decode kernel does.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from hybridflow.engine.kernels.attention_tiles import cache_offsets, softmax_tile
from hybridflow.engine.kernels.launch import PLAIN, Launch
from hybridflow.engine.kernels.pdl import wait_then_release

# Query rows of a program (tokens x the padded head group): 16 tokens of 0.5b's group of 7
# heads (padded to 8), each K/V tile read once for them; not timed on a GPU yet.
TILE_ROWS = 128


def tile_tokens(num_heads: int, num_kv_heads: int) -> int:
    """Tokens of one chunk a program attends for (its rows: these x the padded group)."""
    group = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(1, TILE_ROWS // group)


def tile_count(tokens: int, chunks: int, per_tile: int) -> int:
    """Tiles that always cover `tokens` tokens in up to `chunks` chunks plus the padding
    after them (each chunk's last tile may be partial, and so may the padding's)."""
    return tokens // per_tile + chunks + 2


def chunk_tiles(firsts, counts, slots, tokens: int, per_tile: int, num_tiles: int) -> np.ndarray:
    """The host's tile table [num_tiles, 3] int64 of (slot, first token, end token) for
    chunks at token offsets `firsts` with `counts` tokens each (in [0, tokens), packed from
    0) attending over their sequences' `slots`; the tokens after the chunks get tiles of
    slot -1 (zeros written), the tiles left over (-1, 0, 0) (nothing)."""
    table = np.zeros((num_tiles, 3), dtype=np.int64)
    table[:, 0] = -1
    rows = []
    used = 0
    for first, count, slot in zip(firsts, counts, slots):
        rows += [(slot, s, min(s + per_tile, first + count))
                 for s in range(first, first + count, per_tile)]  # fmt: skip
        used = max(used, first + count)
    rows += [(-1, s, min(s + per_tile, tokens)) for s in range(used, tokens, per_tile)]
    if len(rows) > num_tiles:
        raise ValueError(f"chunk_tiles: {len(rows)} tiles needed, {num_tiles} allocated")
    if rows:
        table[: len(rows)] = rows
    return table


@triton.jit
def _chunk_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, pos_ptr, tile_ptr, out_ptr, table_ptr, sink_ptr, stride_q, stride_o,
    stride_table, stride_cslot, stride_cpos, stride_chead, scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, TOKENS: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, PAGE: tl.constexpr, FP32_DOT: tl.constexpr, WINDOW: tl.constexpr = 0,
    HAS_SINK: tl.constexpr = False, PDL: tl.constexpr = False,
    ks_ptr=None, vs_ptr=None, stride_sslot=0, stride_spos=0, KV_FP8: tl.constexpr = False,
):  # fmt: skip
    """One (tile, kv head): rows r = token * G_PAD + g of the tile's tokens and the group's
    heads; each row attends over its sequence's positions [0, its own position], the last
    WINDOW of them only when WINDOW > 0; HAS_SINK: each head's logit sink[head] joins the
    softmax's denominator (GPT-OSS), as in the decode kernel (attention.py). KV_FP8 (paged;
    cache/fp8_kv.py): the caches hold e4m3 values and ks/vs a scale per (position, kv head)
    [entries, positions, kv heads]; each tile is dequantized to q's dtype before its dots,
    as the decode kernel's (attention_kernel.py)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    wait_then_release(PDL)
    slot = tl.load(tile_ptr + tile * 3)
    first = tl.load(tile_ptr + tile * 3 + 1)
    end = tl.load(tile_ptr + tile * 3 + 2)
    r = tl.arange(0, TOKENS * G_PAD)
    token = first + r // G_PAD
    g = r % G_PAD
    row_mask = (token < end) & (g < G)
    heads = kv_head * G + g
    d = tl.arange(0, D)
    o_offs = token.to(tl.int64)[:, None] * stride_o + heads[:, None] * D + d[None, :]
    attends = row_mask & (token * 0 + slot >= 0)  # rows of a chunk (not padding)
    # positions of the tile's rows; -1 (no key) for rows past its end and padding tiles
    pos = tl.load(pos_ptr + token, mask=attends, other=-1)
    q_offs = token.to(tl.int64)[:, None] * stride_q + heads[:, None] * D + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=attends[:, None], other=0.0)
    last = tl.max(pos, axis=0)
    base = kv_head * stride_chead
    if not PAGE:
        base += tl.maximum(slot, 0).to(tl.int64) * stride_cslot
    m_i = tl.full([TOKENS * G_PAD], -1.0e30, dtype=tl.float32)  # finite: all-masked rows stay 0
    l_i = tl.zeros([TOKENS * G_PAD], dtype=tl.float32)
    acc = tl.zeros([TOKENS * G_PAD, D], dtype=tl.float32)
    if WINDOW:  # the tile's earliest row sees WINDOW - 1 positions back, no further
        lowest = tl.min(tl.where(attends, pos, last), axis=0)
        lo = tl.maximum(lowest - WINDOW + 1, 0)
    else:
        lo = last * 0
    for start in range(lo, last + 1, BLOCK):
        n = start + tl.arange(0, BLOCK)
        n_mask = n <= last
        offs = base + cache_offsets(table_ptr, slot, n, stride_table, stride_cslot, stride_cpos,
                                    PAGE, n_mask)  # fmt: skip
        k = tl.load(kc_ptr + offs[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(vc_ptr + offs[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        if KV_FP8:  # the scales' heads are contiguous: the kv head is their last index
            s_at = kv_head + cache_offsets(table_ptr, slot, n, stride_table, stride_sslot,
                                           stride_spos, PAGE, n_mask)  # fmt: skip
            k_scales = tl.load(ks_ptr + s_at, mask=n_mask, other=0.0)
            v_scales = tl.load(vs_ptr + s_at, mask=n_mask, other=0.0)
            dtype = q_ptr.dtype.element_ty
            k = (k.to(tl.float32) * k_scales[:, None]).to(dtype)
            v = (v.to(tl.float32) * v_scales[:, None]).to(dtype)
        seen = n[None, :] <= pos[:, None]
        if WINDOW:
            seen = seen & (n[None, :] > pos[:, None] - WINDOW)
        m_i, l_i, acc = softmax_tile(q, k, v, seen, m_i, l_i, acc, scale_log2, FP32_DOT)
    if HAS_SINK:  # one more column of the softmax, holding no value
        sink = tl.load(sink_ptr + heads, mask=g < G, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634  # log2 units, as the scores
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def chunk_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    positions: torch.Tensor,
    tiles: torch.Tensor,
    table: torch.Tensor | None = None,
    launch: Launch = PLAIN,
    sinks: torch.Tensor | None = None,
    window: int = 0,
    kv_scales: tuple | None = None,
) -> torch.Tensor:
    """q [T, nh, D] (rows may be strided; heads and dims contiguous), one layer's caches
    ([slots, S, nkv, D], or [blocks, PAGE, nkv, D] with the block table `table` int32),
    positions [T] (each token's cache position, its K/V already stored), tiles [NT, 3] int64
    (chunk_tiles, on the device) -> out [T, nh, D]: token t of a tile attends over its slot's
    positions [0, positions[t]]; tokens of slot -1 tiles get zeros. sinks [nh]: a logit per
    head joining each softmax's denominator (None: none); window > 0: token t attends over
    positions (positions[t] - window, positions[t]] only (a sliding-window layer). kv_scales:
    an FP8 cache's (key scales, value scales) of this layer [blocks, block size, nkv]
    (cache/fp8_kv.py; paged only), the caches then e4m3, as decode_attention's."""
    tokens, num_heads, head_dim = q.shape
    num_kv = key_cache.shape[2]
    group = num_heads // num_kv
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    # the decode kernel's untimed tile: 64 positions a loop at head dim 64, 32 above
    meta = dict(G=group, G_PAD=triton.next_power_of_2(group), D=head_dim,
                TOKENS=tile_tokens(num_heads, num_kv), BLOCK=64 if head_dim <= 64 else 32,
                FP32_DOT=q.dtype == torch.float32, PAGE=0, WINDOW=window,
                HAS_SINK=sinks is not None, num_warps=4 if head_dim <= 64 else 8)  # fmt: skip
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.stride(0) == 1
    table_arg, stride_table = positions, 0
    if table is not None:
        assert table.dtype == torch.int32 and table.stride(1) == 1
        table_arg, stride_table = table, table.stride(0)
        meta["PAGE"] = key_cache.shape[1]
    # e4m3 values read without their scales would be off by each head's scale, silently
    assert (kv_scales is not None) == (key_cache.element_size() == 1), "e4m3 K/V need kv_scales"
    if kv_scales is not None:
        key_scales, value_scales = kv_scales
        assert table is not None, "an FP8 cache is paged"
        assert key_scales.stride() == value_scales.stride() and key_scales.stride(2) == 1
        meta.update(ks_ptr=key_scales, vs_ptr=value_scales, stride_sslot=key_scales.stride(0),
                    stride_spos=key_scales.stride(1), KV_FP8=True)  # fmt: skip
    scale_log2 = (1.0 / math.sqrt(head_dim)) * 1.4426950408889634
    _chunk_attention_kernel[(tiles.shape[0], num_kv)](
        q, key_cache, value_cache, positions, tiles, out, table_arg,
        positions if sinks is None else sinks, q.stride(0), out.stride(0),
        stride_table, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), scale_log2,
        **meta, **launch.keywords(),
    )  # fmt: skip
    return out


def chunk_attention_reference(q, key_cache, value_cache, positions, tiles, table=None,
                              kv_scales=None):  # fmt: skip
    """chunk_attention in torch (fp32 softmax), each token over its slot's gathered K/V;
    kv_scales (paged): e4m3 K/V dequantized to q's dtype (fp8_kv.dequantize_heads)."""
    from hybridflow.engine.cache.fp8_kv import dequantize_heads

    assert kv_scales is None or table is not None, "an FP8 cache is paged"
    out = torch.zeros_like(q)
    group = q.shape[1] // key_cache.shape[2]
    for slot, first, end in tiles.tolist():
        if slot < 0:
            continue
        for t in range(first, end):
            length = int(positions[t]) + 1
            where = torch.arange(length, device=q.device)
            if table is None:
                k, v = key_cache[slot, :length], value_cache[slot, :length]
            else:
                blocks = table[slot, where // key_cache.shape[1]].long()
                at = blocks, where % key_cache.shape[1]
                k, v = key_cache[at], value_cache[at]
                if kv_scales is not None:
                    k = dequantize_heads(k, kv_scales[0][at], q.dtype)
                    v = dequantize_heads(v, kv_scales[1][at], q.dtype)
            k = k.float().repeat_interleave(group, dim=1)  # [L, nh, D]
            v = v.float().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[t].float(), k) / math.sqrt(q.shape[2])
            out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


# -------------------------------------------------------------------------------------------
# Prompts packed back to back, attending over their own K/V (a prefill pass)


def packed_tiles(cu_seqlens: torch.Tensor, tokens: int, per_tile: int) -> tuple:
    """Prompts packed at rows cu_seqlens[i]: cu_seqlens[i+1] of `tokens` -> (tiles [NT, 3]
    int64 of (the prompt's first row, first token, end token), each prompt cut in tiles of
    per_tile tokens, the spare tiles (-1, 0, 0); positions [tokens] int64, each token's
    position in its prompt). On the device, without a host sync: NT is tile_count's bound."""
    device = cu_seqlens.device
    cu = cu_seqlens.long()
    prompts = cu.shape[0] - 1
    counts = (cu[1:] - cu[:-1] + per_tile - 1) // per_tile  # tiles of each prompt
    ends = counts.cumsum(0)
    index = torch.arange(tile_count(tokens, prompts, per_tile), device=device)
    prompt = torch.searchsorted(ends, index, right=True)  # prompts: a spare tile
    used = prompt < prompts
    prompt = prompt.clamp(max=prompts - 1)
    first = cu[prompt] + (index - ends[prompt] + counts[prompt]) * per_tile
    end = torch.minimum(first + per_tile, cu[prompt + 1])
    tiles = torch.stack([torch.where(used, cu[prompt], -1), torch.where(used, first, 0),
                         torch.where(used, end, 0)], dim=1)  # fmt: skip
    rows = torch.arange(tokens, device=device)
    starts = cu[torch.searchsorted(cu[1:], rows, right=True).clamp(max=prompts - 1)]
    return tiles, rows - starts


def rows_as_slots(rows: torch.Tensor) -> torch.Tensor:
    """Packed rows [N, nkv, D] as the kernel's slot cache (a view, nothing copied) whose slot
    and position strides are both a row's: slot s, position n is row s + n, so a prompt
    packed from row s is slot s with its tokens at their positions. The view declares
    [N, 1, nkv, D] (torch bounds a view by its storage); the kernel indexes by the strides,
    reading a prompt's own rows only."""
    stride = rows.stride(0)
    return rows.as_strided(
        (rows.shape[0], 1, *rows.shape[1:]), (stride, stride, *rows.stride()[1:])
    )


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: tuple,
                     sinks: torch.Tensor | None = None, window: int = 0,
                     launch: Launch = PLAIN) -> torch.Tensor:  # fmt: skip
    """Causal attention of packed prompts over their own keys: q [N, nh, D], k/v [N, nkv, D]
    (contiguous heads and dims), layout: packed_tiles' (tiles, positions) -> [N, nh, D];
    sinks, window: as chunk_attention's. Every token must be in a prompt (cu_seqlens[-1] = N):
    the rows no tile covers are left unwritten."""
    tiles, positions = layout
    return chunk_attention(q, rows_as_slots(k), rows_as_slots(v), positions, tiles,
                           launch=launch, sinks=sinks, window=window)  # fmt: skip
