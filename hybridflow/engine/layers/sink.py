"""Sink attention (GPT-OSS) in the engine's eager passes: prefill, extend and decode of a
``sink_attention`` layer over its cache kind, the full layers' K/V (slot cache or blocks) or
the sliding layers' ring (cache/window.py).

A head's learned sink logit joins the softmax's denominator as one more column that holds
no value (models/mixers/sink_attention.py). ``sink_softmax`` is the pure-torch form over
gathered keys; decode may run kernels/attention.py's Triton kernel instead (``kernel``),
which folds the sink into the same denominator.

Prefill runs the model's packed attention in row blocks (the model's arithmetic), or every
prompt of the pass in one launch of kernels/chunk_attention.py with the sink and the window
(the Triton step: the row blocks cost ~19 launches a prompt and layer, ~117k for 256 prompts
through gpt-oss-20b's 24 layers), then keeps each prompt's last window of K/V on a sliding
layer. Extend (new tokens after a sequence's cached ones: a kept turn, a chunked prompt, a
mixed step's decode rows) attends a sliding layer's tokens over their ring as it was before
the pass plus the pass's own earlier tokens, then stores the pass's last window, so the ring
never needs more than a window.
"""

from __future__ import annotations

import torch

from hybridflow.engine.cache.window import ring_positions, store_last_positions

# Scores a prefill pass holds at once (fp32 elements, heads x queries x keys): its queries
# run in row blocks of at most this, so a long prompt's attention stays bounded (the model's
# reference holds [heads, T, T] a sequence: 16 GiB at 8k tokens and 64 heads).
PREFILL_SCORES = 2**25


def sink_softmax(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [T, nh, D], keys/values [T, S, nkv, D] (row t's keys) or [S, nkv, D] (the same keys
    for every row), visible [T, S] bool, sinks [nh] (None: a plain softmax) -> [T, nh, D];
    scores and softmax in fp32, as the model's."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[-2]
    groups = heads // kv_heads
    if keys.dim() == 3:  # shared keys: a kv head's queries of every row in one matmul
        grouped = q.view(rows, kv_heads, groups, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
        k, v = keys.transpose(0, 1), values.transpose(0, 1)  # [nkv, S, D]
        scores = (grouped @ k.transpose(-1, -2)).float() * dim**-0.5  # [nkv, T * G, S]
        scores = scores.view(kv_heads, rows, groups, -1).transpose(0, 1)  # [T, nkv, G, S]
    else:
        grouped = q.view(rows, kv_heads, groups, dim)  # a kv head's queries together
        k, v = keys.transpose(1, 2), values.transpose(1, 2)  # [T, nkv, S, D]
        scores = (grouped @ k.transpose(-1, -2)).float() * dim**-0.5  # [T, nkv, G, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, groups, 1).expand(rows, -1, -1, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.to(v.dtype)
    if keys.dim() == 3:
        out = probs.transpose(0, 1).reshape(kv_heads, -1, probs.shape[-1]) @ v  # [nkv, T*G, D]
        return out.view(kv_heads, rows, groups, dim).transpose(0, 1).reshape(rows, heads, dim)
    return (probs @ v).view(rows, heads, dim)


def sink_prefill(layer, normed, cos, sin, cache, index: int, cache_at: tuple,
                 token_slots: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                 last_index: torch.Tensor, tiled: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """Packed prompts [N, H] (prefill.prefill_forward's) -> the mixer's output [N, H]; K/V
    to the full layer's cache at cache_at (entries, offsets), or each prompt's last window to
    its slot's ring. tiled: the prompts' kernels/chunk_attention.packed_tiles, to attend
    through that kernel (one launch a layer, the sink and window in it); None: in torch."""
    mixer = getattr(layer, layer.mixer_name)
    q, k, v = mixer.project_qkv(normed, cos, sin)
    window = attended_window(layer, cache)
    if window:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        ends = torch.repeat_interleave(positions[last_index], lengths, output_size=len(positions))
        store_last_positions(cache.window.layer(index), k, v, token_slots, positions, ends,
                             cache.scratch_slot)  # fmt: skip
    else:
        _store(cache, index, cache_at, k, v)
    if tiled is None:
        out = sink_prefill_attention(q, k, v, mixer.sinks, window, cu_seqlens)
    else:
        from hybridflow.engine.kernels.chunk_attention import packed_attention

        out = packed_attention(q, k, v, tiled, mixer.sinks, window)
    return mixer.o_proj(out.flatten(-2))


def attended_window(layer, cache) -> int:
    """The window a layer attends in the engine (0: none): its own, capped at its ring's
    length (window.ring_length). A sequence of the engine never holds more positions than
    the ring, so the cap changes nothing it reads, and the kernels' masks never meet a
    window of 2**31 - 1."""
    window = layer.spec.window
    return min(window, cache.window.window) if window else 0


def sink_prefill_attention(q, k, v, sinks, window: int, cu_seqlens: torch.Tensor,
                           scores: int = PREFILL_SCORES) -> torch.Tensor:  # fmt: skip
    """models/mixers/sink_attention.sink_attention_packed's contract (q [N, nh, D], k/v
    [N, nkv, D], sequence i at rows cu_seqlens[i]: cu_seqlens[i+1] -> [N, nh, D]) in row
    blocks holding at most `scores` scores each: a block of queries [a, b) reads the keys
    [a - window + 1, b) of a sliding layer (a window's worth past the block), [0, b) of a
    full one."""
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    heads = q.shape[1]
    for first, end in zip(bounds[:-1], bounds[1:]):
        span = min(end - first, window) if window else end - first
        rows = max(1, scores // (heads * span * 2))  # keys of a block: at most span + rows
        for a in range(first, end, rows):
            b = min(a + rows, end)
            lo = max(first, a - window + 1) if window else first
            positions = torch.arange(a, b, device=q.device)[:, None]
            keys = torch.arange(lo, b, device=q.device)[None, :]
            visible = (keys <= positions) & ((positions - keys < window) if window else True)
            out[a:b] = sink_softmax(q[a:b], k[lo:b], v[lo:b], visible, sinks)
    return out


def sink_decode(layer, normed, cos, sin, cache, index: int, cache_at: tuple,
                row_slots: torch.Tensor, positions: torch.Tensor, max_len: int,
                targets: torch.Tensor, kernel: bool = False) -> torch.Tensor:  # fmt: skip
    """One token a row [B, H] (layers/eager.decode_forward_torch's) -> [B, H]. A full layer
    stores at cache_at and attends positions [0, p]; a sliding layer stores in its ring at
    entry p % window of slot targets[b] (the scratch slot for a frozen row) and attends the
    ring's first min(p + 1, window) entries, positions p - window + 1 .. p. No host sync
    (CUDA graphs). kernel: the Triton decode kernel instead of sink_softmax, and the ropes
    and stores in one launch (_rope_store)."""
    mixer = getattr(layer, layer.mixer_name)
    if layer.spec.window:
        keys, values = cache.window.layer(index)
        size = keys.shape[1]
        store_at = (targets, torch.remainder(positions, size))
        lengths, table, max_len = (positions + 1).clamp(max=size), None, size
    else:
        row = cache.kv_row(index)
        keys, values = cache.keys[row], cache.values[row]
        store_at = cache_at
        lengths, table = positions + 1, cache.block_table
    if kernel:
        from hybridflow.engine.kernels.attention import decode_attention

        q = _rope_store(mixer, normed, cos, sin, keys, values, store_at)
        out = decode_attention(q, keys, values, row_slots, lengths, max_len, table=table,
                               sinks=mixer.sinks)  # fmt: skip
    else:
        q, k, v = mixer.project_qkv(normed, cos, sin)
        keys[store_at] = k
        values[store_at] = v
        if table is None:
            rows_keys, rows_values = keys[row_slots, :max_len], values[row_slots, :max_len]
        else:
            rows_keys = cache.gather(keys, row_slots, max_len)
            rows_values = cache.gather(values, row_slots, max_len)
        visible = torch.arange(max_len, device=q.device)[None, :] < lengths[:, None]
        out = sink_softmax(q, rows_keys, rows_values, visible, mixer.sinks)
    return mixer.o_proj(out.flatten(-2))


def _rope_store(mixer, normed, cos, sin, keys, values, at: tuple) -> torch.Tensor:
    """project_qkv's q; its k and v stored at keys/values[at[0], at[1]]: the projections,
    then q and k turned and both stored in one launch (kernels/rowwise.rope_store, the
    model's rounding), where the model's rope and the two indexed stores take ~12."""
    from hybridflow.engine.kernels.rowwise import rope_store

    q, k, v = (proj(normed).unflatten(-1, (-1, mixer.head_dim))
               for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj))  # fmt: skip
    rows = torch.arange(q.shape[0], device=q.device)  # cos/sin hold the rows' own already
    rope_store(q, k, v, cos, sin, rows, at[0], keys, values, cache_positions=at[1])
    return q


def sink_extend(layer, normed, cos, sin, cache, index: int, cache_at: tuple,
                slots: torch.Tensor, positions: torch.Tensor, max_len: int,
                frozen: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """New tokens [N, H] of sequences whose earlier tokens are cached (prefill.extend_forward's:
    each sequence's tokens contiguous, in position order, one slot each) -> [N, H]. frozen
    [N] (None: none): tokens whose ring must not change (finished decode rows), stored to
    the scratch slot."""
    mixer = getattr(layer, layer.mixer_name)
    q, k, v = mixer.project_qkv(normed, cos, sin)
    window = attended_window(layer, cache)
    if not window:  # stored first: a token reads the pass's earlier tokens from the cache
        _store(cache, index, cache_at, k, v)
        row = cache.kv_row(index)
        keys = cache.gather(cache.keys[row], slots, max_len)
        values = cache.gather(cache.values[row], slots, max_len)
        visible = torch.arange(max_len, device=q.device)[None, :] < positions[:, None] + 1
        out = sink_softmax(q, keys, values, visible, mixer.sinks)
        return mixer.o_proj(out.flatten(-2))
    ring = cache.window.layer(index)
    starts, ends = _runs(slots)
    out = windowed_extend_attention(q, k, v, ring, slots, positions, starts, window,
                                    mixer.sinks)  # fmt: skip
    targets = slots
    if frozen is not None:
        targets = torch.where(frozen, torch.full_like(slots, cache.scratch_slot), slots)
    store_last_positions(ring, k, v, targets, positions, positions[ends], cache.scratch_slot)
    return mixer.o_proj(out.flatten(-2))


def windowed_extend_attention(q, k, v, ring: tuple, slots, positions, starts, window: int,
                              sinks, rows_per_pass: int = 256) -> torch.Tensor:  # fmt: skip
    """q [N, nh, D], k/v [N, nkv, D] of the pass's tokens, ring (keys, values) [slots + 1,
    size, nkv, D] as before the pass (size: window.ring_length, at most window), starts [N]:
    the index of each token's sequence's first token in the pass -> [N, nh, D]. Token t at
    position p sees the ring's positions before its sequence's first new one and the pass's
    tokens of its sequence, both within p - window + 1 .. p. In passes of rows_per_pass
    tokens (the gathered keys stay bounded)."""
    ring_keys, ring_values = ring
    size = ring_keys.shape[1]
    index = torch.arange(q.shape[0], device=q.device)
    held = ring_positions(positions[starts] - 1, size)  # [N, size]
    ring_visible = (held >= 0) & (positions[:, None] - held < window)
    # the pass's earlier tokens a token sees: at most window - 1 back, and fewer than a ring's
    # worth (a ring shorter than the window holds a sequence whole: ring_length)
    span = min(window, size)
    back = index[:, None] - torch.arange(span - 1, -1, -1, device=q.device)[None, :]
    back_visible = back >= starts[:, None]  # the same sequence
    back = back.clamp(min=0)
    pieces = []
    for first in range(0, q.shape[0], rows_per_pass):
        part = slice(first, first + rows_per_pass)
        keys = torch.cat((ring_keys[slots[part]], k[back[part]]), dim=1)
        values = torch.cat((ring_values[slots[part]], v[back[part]]), dim=1)
        visible = torch.cat((ring_visible[part], back_visible[part]), dim=1)
        pieces.append(sink_softmax(q[part], keys, values, visible, sinks))
    return torch.cat(pieces)


def frozen_tokens(frozen: torch.Tensor | None, decode_rows: int, start: int,
                  count: int) -> torch.Tensor | None:  # fmt: skip
    """Which of an extend chunk's `count` tokens (from token `start` of the pass) are frozen
    decode rows (frozen [decode_rows]): [count] bool, or None when none can be."""
    if frozen is None or start >= decode_rows:
        return None
    held = torch.zeros(count, dtype=torch.bool, device=frozen.device)
    rows_here = min(decode_rows - start, count)
    held[:rows_here] = frozen[start : start + rows_here]
    return held


def _runs(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [N] in runs of one slot (a sequence's contiguous tokens) -> (index of each
    token's run's first token, of its last), without a host sync."""
    count = slots.shape[0]
    index = torch.arange(count, device=slots.device)
    new = torch.ones(count, dtype=torch.bool, device=slots.device)
    new[1:] = slots[1:] != slots[:-1]
    starts = torch.where(new, index, 0).cummax(0).values
    last = torch.ones_like(new)
    last[:-1] = new[1:]
    ends = torch.where(last, index, count - 1).flip(0).cummin(0).values.flip(0)
    return starts, ends


def _store(cache, index: int, cache_at: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
    row = cache.kv_row(index)
    cache.keys[row, cache_at[0], cache_at[1]] = k
    cache.values[row, cache_at[0], cache_at[1]] = v
