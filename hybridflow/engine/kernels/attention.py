"""Decode attention kernels: each row's queries over its live cache length (GQA, split-K
flash-decoding), with RoPE and the new token's cache store fused in (CUDA; CPU under
TRITON_INTERPRET=1 in tests). They share rowwise.py's _rotate.

What the H200 measured: ~2.6 TB/s at 256 rows and 3.2 TB/s at
1024 rows of 0.5b (256 cached tokens); the tile is autotuned per row bucket; sequence splits
only pay when rows x kv heads do not fill the GPU.
"""

from __future__ import annotations

import math

import torch
import triton

from hybridflow.engine.kernels import sm_count
from hybridflow.engine.kernels.attention_kernel import (
    _combine_splits_kernel,
    _decode_attention_kernel,
)
from hybridflow.engine.kernels.launch import PLAIN, Launch

# Tried on the first call of each shape (outside graph capture; the kernel only writes its
# outputs and, with ROPE, the same k/v at the same cache position, so re-running it while
# tuning is harmless). Interpreter runs use the first config.
_ATTENTION_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "STORE_LAST": last}, num_warps=w, num_stages=st)
    for bn, w, st in [(64, 4, 2), (32, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 3), (128, 8, 3)]
    for last in (False, True)
]


def _prune_store_orders(configs, named_args, **kwargs):
    """Both store orders where there is a store (ROPE), else the store-first configs only."""
    return [c for c in configs if kwargs.get("ROPE") or not c.kwargs["STORE_LAST"]]


_decode_attention_tuned = triton.autotune(
    _ATTENTION_CONFIGS,
    key=[
        "G",
        "HALF",
        "SPLITS",
        "FP32_DOT",
        "ROPE",
        "ROWS_BUCKET",
        "stride_cpos",
        "NORM",
        "SHARED",
        "PAGE",
        "KV_FP8",
    ],  # fmt: skip
    prune_configs_by={"early_config_prune": _prune_store_orders},
)(_decode_attention_kernel)


def attention_splits(rows: int, num_kv_heads: int, max_len: int, sms: int) -> int:
    """Sequence splits per (row, kv head): enough thread blocks to fill ~2 waves of the
    device's `sms` SMs, but at least 256 positions per split."""
    programs = rows * num_kv_heads
    splits = max(1, math.ceil(2 * sms / programs))
    return max(1, min(splits, max_len // 256, 16))


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    row_slots: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    *,
    splits: int | None = None,
    shared: tuple | None = None,
    launch: Launch = PLAIN,
    autotune: bool = True,
    table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: tuple | None = None,
) -> torch.Tensor:
    """q [B, nh, D] (rows may be strided), caches [slots, S, nkv, D], lengths [B] -> out
    [B, nh, D]: row b attends over positions [0, lengths[b]) of slot row_slots[b]. max_len is
    a static bound on lengths (it only sizes the splits). shared: (first [B], groups) from
    shared_prefix.group_table: each group's prefix read once (one split). autotune: time the
    tile per shape (CUDA), else a fixed tile. table: a paged cache's block table [slots,
    blocks per sequence] (int32; the caches then [blocks, block size, nkv, D]). sinks: [nh]
    per-head sink logits joining each softmax's denominator (GPT-OSS), or None. kv_scales:
    an FP8 cache's (key scales, value scales) of this layer [blocks, block size, nkv]
    (cache/fp8_kv.py; paged only), the caches then e4m3."""
    return _attention(q, None, None, None, None, lengths - 1, key_cache, value_cache,
                      row_slots, max_len, splits, shared=shared, launch=launch,
                      autotune=autotune, table=table, sinks=sinks,
                      kv_scales=kv_scales)  # fmt: skip


def decode_attention_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    row_slots: torch.Tensor,
    max_len: int,
    *,
    splits: int | None = None,
    norm: tuple | None = None,
    shared: tuple | None = None,
    launch: Launch = PLAIN,
    autotune: bool = True,
    table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: tuple | None = None,
    shifts: torch.Tensor | None = None,
) -> torch.Tensor:
    """rope_store + decode_attention in one launch: q [B, nh, D], k/v [B, nkv, D] of the new
    token (unrotated; rows may be strided), cos/sin [S, D] tables, positions [B] (the new
    token's position). Stores rotated k and v at cache[row_slots, positions] and returns the
    attention over positions [0, positions[b]] -> [B, nh, D]. q is not modified.

    norm: (residual [B, H], eps, qkv bias [nh*D + 2*nkv*D] or None): q/k/v are
    residual @ W^T with the RMSNorm weight folded into W and without the bias; the kernel
    scales them by each row's 1/rms(residual) and adds the bias (lean.py).

    shared: (first [B], groups) from shared_prefix.group_table: each group's prompt prefix
    is read once for all its rows (one split). table, sinks, kv_scales: as
    decode_attention's (an FP8 cache's new k/v are stored quantized).

    shifts: each slot's rotary shift [slots] (RopeTable.slot_shift, long; mRoPE prompts with
    images): row b turns at positions[b] + shifts[row_slots[b]], stored and attended at
    positions[b]. None: at positions[b]."""
    return _attention(q, k, v, cos, sin, positions, key_cache, value_cache, row_slots,
                      max_len, splits, norm=norm, shared=shared, launch=launch,
                      autotune=autotune, table=table, sinks=sinks,
                      kv_scales=kv_scales, shifts=shifts)  # fmt: skip


def _attention(
    q, k, v, cos, sin, positions, key_cache, value_cache, row_slots, max_len, splits, *,
    norm: tuple | None = None, shared: tuple | None = None, launch: Launch = PLAIN,
    autotune: bool = True, store_last: bool = False, table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None, kv_scales: tuple | None = None,
    shifts: torch.Tensor | None = None,
):  # fmt: skip
    """store_last: the untuned launch's store order (the tuner times both; tests force one)."""
    rows, num_heads, head_dim = q.shape
    num_kv = key_cache.shape[2]
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    group = num_heads // num_kv
    rope = k is not None
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    if rope:
        assert k.stride(1) == head_dim and v.stride(1) == head_dim
        assert k.stride(2) == 1 and v.stride(2) == 1
    sms = sm_count(q.device)
    if shared is not None and splits is None and attention_splits(rows, num_kv, max_len, sms) > 1:
        # too few rows to fill the GPU: the sequence splits (a row's positions over several
        # programs) do that; sharing needs one split, so these batches read their prefixes
        # as usual (the tail of a call, once most rows have finished)
        shared = None
    if shared is not None:
        splits = 1  # the prefix is the other "split" (shared_prefix.prefix_attention)
    if splits is None:
        splits = attention_splits(rows, num_kv, max_len, sms)
    chunk = triton.cdiv(max_len, splits)
    out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        part_o = torch.empty(rows, num_heads, splits, head_dim, device=q.device)
        part_lse = torch.empty(rows, num_heads, splits, device=q.device)
    else:
        part_o = part_lse = out
    scale_log2 = (1.0 / math.sqrt(head_dim)) * 1.4426950408889634
    args = (
        q, k if rope else q, v if rope else q, cos if rope else q, sin if rope else q,
        key_cache, value_cache, row_slots, positions, out, part_o, part_lse, q.stride(0),
        k.stride(0) if rope else 0, v.stride(0) if rope else 0, cos.stride(0) if rope else 0,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), out.stride(0), scale_log2,
        chunk,
        max(16, triton.next_power_of_2(rows)),  # ROWS_BUCKET: only keys the tuning
    )  # fmt: skip
    meta = dict(
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), HALF=head_dim // 2,
        NH=num_heads, SPLITS=splits, FP32_DOT=q.dtype == torch.float32, ROPE=rope,
    )  # fmt: skip
    if table is not None:
        assert table.dtype == torch.int32 and table.stride(1) == 1
        meta.update(table_ptr=table, stride_table=table.stride(0), PAGE=key_cache.shape[1])
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.stride(0) == 1
        meta.update(sink_ptr=sinks, HAS_SINK=True)
    if kv_scales is not None:  # the shared-prefix kernel reads model-dtype K/V only
        key_scales, value_scales = kv_scales
        assert table is not None and shared is None, "an FP8 cache is paged, not shared"
        assert key_scales.stride() == value_scales.stride() and key_scales.stride(2) == 1
        meta.update(ks_ptr=key_scales, vs_ptr=value_scales, stride_sslot=key_scales.stride(0),
                    stride_spos=key_scales.stride(1), KV_FP8=True)  # fmt: skip
    if shifts is not None:
        assert rope and shifts.dtype == torch.int64, "shifts: long, with the new token's k/v"
        meta.update(shift_ptr=shifts, ROPE_SHIFT=True)
    if norm is not None:
        assert rope, "norm needs the new token's k/v (decode_attention_rope)"
        residual, eps, bias = norm
        assert residual.stride(1) == 1 and residual.shape[0] == rows
        meta.update(h_ptr=residual, bias_ptr=bias if bias is not None else residual,
                    stride_h=residual.stride(0), H=residual.shape[1], eps=eps, NORM=True,
                    H_PAD=triton.next_power_of_2(residual.shape[1]),
                    HAS_BIAS=bias is not None)  # fmt: skip
    states = None
    if shared is not None:
        from hybridflow.engine.kernels import shared_prefix

        first, groups = shared
        states = shared_prefix.state_buffers(q)
        meta.update(first_ptr=first, qs_ptr=states[0], pm_ptr=states[1], pl_ptr=states[2],
                    pacc_ptr=states[3], SHARED=True)  # fmt: skip
        # the prefix kernel after it may launch early to prefetch (Launch.pair_pdl)
        meta.update(launch.pair_keywords())
    else:
        meta.update(launch.keywords())
    grid = (rows, num_kv, splits)
    if q.is_cuda and autotune:
        _decode_attention_tuned[grid](*args, **meta)
    else:  # by default the store in front: best at head dim 128, and the one without ROPE
        _decode_attention_kernel[grid](*args, **meta, BLOCK_N=64 if head_dim <= 64 else 32,
                                       STORE_LAST=store_last and rope)  # fmt: skip
    if states is not None:
        shared_prefix.prefix_attention(states, groups, key_cache, value_cache, out, launch,
                                       table=table)  # fmt: skip
    elif splits > 1:
        _combine_splits_kernel[(rows, num_heads)](
            part_o, part_lse, out, out.stride(0), NH=num_heads, D=head_dim, SPLITS=splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(splits)), **launch.keywords(),
        )  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------
# The autotuner's choices, in and out (pinned across processes: engine/choices.py)


def tuned_tiles() -> dict[str, dict]:
    """The attention tiles the autotuner chose in this process: repr(tuning key) ->
    {"key": [...], "config": {kwargs, num_warps, num_stages}}."""
    out = {}
    for key, config in getattr(_decode_attention_tuned, "cache", {}).items():
        out[repr(key)] = {"key": list(key), "config": {
            "kwargs": dict(config.kwargs), "num_warps": config.num_warps,
            "num_stages": config.num_stages}}  # fmt: skip
    return out


def pin_tiles(entries: dict[str, dict]) -> int:
    """Seed the autotuner with tiles chosen earlier (tuned_tiles' format): a shape met again
    runs the same tile without timing. Entries whose config is no longer a candidate are
    skipped. Returns how many were seeded."""
    seeded = 0
    for entry in entries.values():
        wanted = entry["config"]
        for config in _ATTENTION_CONFIGS:
            if (dict(config.kwargs) == wanted["kwargs"] and config.num_warps == wanted["num_warps"]
                    and config.num_stages == wanted["num_stages"]):  # fmt: skip
                _decode_attention_tuned.cache[tuple(entry["key"])] = config
                seeded += 1
                break
    return seeded
