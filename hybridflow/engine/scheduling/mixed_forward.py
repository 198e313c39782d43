"""The forward of a mixed step with static shapes (scheduling/static_step.py): a bucket of
decode rows and a token bucket of prompt chunks, padded, through the extend pass's fused
kernels. Every tensor it reads lives at a fixed address and every size is the buckets', so
the step is captured as a CUDA graph and replayed; on the CPU (and with cuda_graphs off) the
same function runs eagerly.

Against the eager extend pass (prefill.extend_forward_triton) only the chunks' attention
differs: the paged varlen kernel (kernels/chunk_attention.py) reads each chunk's cached
prefix and its own K/V through the block table, where FlashAttention's varlen kernel takes
K/V gathered to a size read from the data. Over an FP8 KV cache (cache/fp8_kv.py) every
kernel takes the layer's scales, as the extend pass's: the stores quantize, the readers
dequantize each tile.
"""

from __future__ import annotations

import functools

import torch

from hybridflow.engine.cache.kv_cache import KVCache
from hybridflow.engine.kernels.launch import PLAIN, Launch
from hybridflow.engine.rope_table import RopeTable


@torch.no_grad()
def mixed_forward_static(
    model,
    cache: KVCache,
    rope: RopeTable,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache_at: tuple[torch.Tensor, torch.Tensor],
    row_slots: torch.Tensor,
    keep: torch.Tensor,
    tiles: torch.Tensor,
    fused=None,
    matmul=None,
    launch: Launch = PLAIN,
    chunk_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """input_ids/positions [R + T]: R decode rows (row_slots [R], padding rows on the scratch
    slot) then T chunk tokens (padding tokens at position 0 of the scratch entry); cache_at:
    every token's (entry, offset), where rope_store writes its K/V; tiles: the chunks'
    chunk_tiles on the device; keep [K]: the tokens whose logits come out -> [K, V].

    Each decode row attends over its slot like a decode step (decode_attention, the untimed
    tile, as the extend pass), each chunk token over its sequence up to its position. A
    decode row turns at its position plus its slot's rotary shift (RopeTable.slot_shift,
    read in the graph: mRoPE prompts with images); chunk tokens at their positions (a step
    holding a chunk of a prompt with images runs eagerly: mixed.run_step), or, given chunk_slots
    [T] (a verify pass's drafts, which continue their rows), plus their slot's shift too."""
    from hybridflow.engine.kernels import attention, rowwise
    from hybridflow.engine.kernels.chunk_attention import chunk_attention
    from hybridflow.engine.layers.moe import route_target
    from hybridflow.engine.layers.split import fused_layers

    rows = row_slots.shape[0]
    entries, offsets = cache_at
    lengths = positions[:rows] + 1
    rotary = positions
    if rope.slot_shift is not None:
        chunk_rotary = positions[rows:]
        if chunk_slots is not None:
            chunk_rotary = rope.rotary_positions(chunk_rotary, chunk_slots)
        rotary = torch.cat([rope.rotary_positions(positions[:rows], row_slots), chunk_rotary])

    def attend(index, q, k, v):
        keys, values = cache.keys[index], cache.values[index]
        scales = cache.layer_scales(index)  # an FP8 cache's (fixed addresses too), or None
        rowwise.rope_store(q, k, v, rope.cos, rope.sin, rotary, entries, keys, values,
                           launch=launch, cache_positions=offsets, kv_scales=scales)  # fmt: skip
        decoded = attention.decode_attention(
            q[:rows], keys, values, row_slots, lengths, cache.max_seq_len, launch=launch,
            autotune=False, table=cache.block_table, kv_scales=scales,
        )  # fmt: skip
        chunked = chunk_attention(q[rows:], keys, values, positions[rows:], tiles,
                                  table=cache.block_table, launch=launch,
                                  kv_scales=scales)  # fmt: skip
        return torch.cat([decoded, chunked])

    # the experts (a mixture-of-experts model) on the Triton kernels, whose shapes are static
    # whatever the routing (decode graphs run them); not torch._grouped_mm's prefill path
    normed = fused_layers(model, input_ids, attend, fused, matmul, keep=keep, launch=launch,
                          routes=route_target(cache, entries, offsets))  # fmt: skip
    return model.lm_head(normed)


def static_forward_of(extend) -> functools.partial | None:
    """mixed_forward_static with the engine's extend pass's weights and kernels (its
    keywords), or None where the extend pass is not the fused one (the torch backend: hybrid,
    MLA and sink-attention models run the model's own modules, whose chunk passes size their
    work from the data)."""
    from hybridflow.engine.prefill import extend_forward_triton

    if not isinstance(extend, functools.partial) or extend.func is not extend_forward_triton:
        return None
    keywords = {name: extend.keywords.get(name) for name in ("fused", "matmul")}
    return functools.partial(mixed_forward_static, launch=extend.keywords.get("launch", PLAIN),
                             **keywords)  # fmt: skip
