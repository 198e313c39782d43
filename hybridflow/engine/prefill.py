"""Prefill: packed prompts (no padding) -> K/V written into their cache slots, logits of each
prompt's last token. Two implementations, same contract: `prefill_forward` (the model's own
modules, eager; the torch backend) and `prefill_forward_triton` (the decode layer's fused
kernels around the model's packed attention).

Only each prompt's last token needs the last layer past its attention: every token's K/V is
in the cache once the last layer's q/k/v are, and the logits are the last tokens'. So that
layer's o_proj, MLP and norms run on the last tokens only (per token, so the same values):
1/L of the prefill's MLP work saved (L = 24 layers at 0.5b).
"""

from __future__ import annotations

import torch

from hybridflow.engine.cache.kv_cache import KVCache
from hybridflow.engine.kernels.launch import PLAIN, Launch
from hybridflow.engine.rope_table import RopeTable
from hybridflow.engine.weights.fused import FusedProjections
from hybridflow.models.attention import make_packed_attention, resolve_backend
from hybridflow.models.mixers.gated_deltanet import TokenLayout


@torch.no_grad()
def prefill_forward(
    model,
    cache: KVCache,
    rope: RopeTable,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    token_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    last_index: torch.Tensor,
    cache_at: tuple | None = None,
    inputs: tuple | None = None,
    attention_step: str = "torch",
    expert_step: str = "torch",
    fp8_experts=None,
) -> torch.Tensor:
    """input_ids/position_ids/token_slots [N] (prompts packed), cu_seqlens int32 [P+1],
    last_index [P] (index in N of each prompt's last token) -> logits [P, V] (model dtype).

    Every token's K/V goes to cache[layer, token_slots, position_ids], or to cache[layer,
    *cache_at] when given (a paged cache: each token's block and offset, kv_cache.py).
    inputs: (hidden [N, H], cos, sin [N, D]) instead of the ids' embeddings and the RoPE
    table's rows at position_ids: prompts with images (engine/images.py). attention_step:
    "triton" runs sink-attention layers (GPT-OSS) through the packed prompts' kernel
    (layers/sink.py), "torch" in torch. expert_step: "triton" runs GPT-OSS's biased experts
    through torch._grouped_mm with the biases and the clamped SwiGLU in row-wise kernels
    (layers/biased_moe.py), "torch" through the model's. fp8_experts: as
    layers/eager.decode_forward_torch's."""
    from hybridflow.engine.layers import mixing
    from hybridflow.engine.layers.eager import layer_fp8_experts
    from hybridflow.engine.layers.latent import latent_prefill
    from hybridflow.engine.layers.moe import mlp_torch, route_target, sparse_indices
    from hybridflow.engine.layers.sink import sink_prefill

    entries, offsets = cache_at or (token_slots, position_ids)
    target = route_target(cache, entries, offsets)
    sparse = sparse_indices(model)
    if inputs is None:
        hidden = model.model.embed_tokens(input_ids)  # [N, H]
        cos, sin = rope.cos[position_ids], rope.sin[position_ids]  # [N, D]
    else:
        hidden, cos, sin = inputs
    backend = resolve_backend(model.attention_backend, hidden.device, hidden.dtype)
    attend = make_packed_attention(backend, cu_seqlens, max_seqlen, input_ids.shape[0])
    layout = sequence_slots = None
    if cache.states is not None:  # each prompt's state goes to its (first) slot
        layout = TokenLayout.packed(cu_seqlens, max_seqlen)
        sequence_slots = token_slots[cu_seqlens[1:].long() - 1]
    layers = model.model.layers
    tiled = (
        _sink_tiles(model, cu_seqlens, input_ids.shape[0]) if attention_step == "triton" else None
    )
    for index, layer in enumerate(layers):
        normed = layer.input_layernorm(hidden)
        if layer.spec.recurrent:
            out = mixing.recurrent_prefill(layer, normed, layout, cache.states, index,
                                           sequence_slots)  # fmt: skip
        elif layer.spec.mixer == "sink_attention":
            out = sink_prefill(layer, normed, cos, sin, cache, index, (entries, offsets),
                               token_slots, position_ids, cu_seqlens, last_index, tiled)  # fmt: skip
        elif layer.spec.cache == "latent":
            out = latent_prefill(layer, normed, cos, sin, cache, index, (entries, offsets), attend)
        else:
            row = cache.kv_row(index)

            def store(k, v, row=row):
                cache.store(row, entries, offsets, k, v)

            out = mixing.kv_mixer(layer, normed, cos, sin, store, attend)
        # the last tokens only (see above); a sparse layer routes (records) every token first
        trim = index + 1 == len(layers)
        if trim and sparse[index] is None:
            hidden, out = hidden[last_index], out[last_index]
        hidden = hidden + out
        keep = last_index if trim and sparse[index] is not None else None
        delta = mlp_torch(layer, layer.post_attention_layernorm(hidden), target, sparse[index],
                          keep, expert_step, layer_fp8_experts(fp8_experts, index))  # fmt: skip
        hidden = (hidden if keep is None else hidden[keep]) + delta
    return model.lm_head(model.model.norm(hidden))


def _sink_tiles(model, cu_seqlens: torch.Tensor, tokens: int) -> tuple | None:
    """The packed prompts' tiles for the sink layers' kernel, made once for all the layers
    (kernels/chunk_attention.packed_tiles); None: the model has no sink layer."""
    if not any(layer.spec.mixer == "sink_attention" for layer in model.model.layers):
        return None
    from hybridflow.engine.kernels.chunk_attention import packed_tiles, tile_tokens

    config = model.config
    per_tile = tile_tokens(config.num_attention_heads, config.num_key_value_heads)
    return packed_tiles(cu_seqlens, tokens, per_tile)


@torch.no_grad()
def prefill_forward_triton(
    model,
    cache: KVCache,
    rope: RopeTable,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    token_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    last_index: torch.Tensor,
    fused: FusedProjections | None = None,
    matmul=None,
    launch: Launch = PLAIN,
    cache_at: tuple | None = None,
    experts=None,
    inputs: tuple | None = None,
) -> torch.Tensor:
    """Same contract as prefill_forward, with the decode step's fused kernels around the
    model's packed attention (the split layer's stack, layers/split.py). experts: a
    layers.moe.ExpertMatmuls (mixture-of-experts models). inputs: as prefill_forward's
    (prompts with images), the same kernels over them (an fp8 engine's matmuls included)."""
    entries, offsets = cache_at or (token_slots, None)
    cos, sin, turns = rope_rows(rope, position_ids, inputs)
    if offsets is None and turns is not position_ids:  # stored at the cache position
        offsets = position_ids
    from hybridflow.engine.kernels import rowwise
    from hybridflow.engine.layers.moe import route_target
    from hybridflow.engine.layers.split import fused_layers

    routes = route_target(cache, *(cache_at or (token_slots, position_ids)))

    backend = resolve_backend(model.attention_backend, input_ids.device, model.dtype)
    packed = make_packed_attention(backend, cu_seqlens, max_seqlen, input_ids.shape[0])
    if backend == "flash_varlen":
        # q and v are column slices of the fused qkv product: the flash kernel takes their
        # row stride as is (flash_varlen_attention's .contiguous() copies cost ~20 us a
        # layer per 16k tokens on the H200).
        def packed(q, k, v):
            return torch.ops.aten._flash_attention_forward(
                q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False
            )[0]

    def attend(index, q, k, v):
        # k rotated in place (a strided view of the qkv product, like q and v): gathering the
        # rotated keys back from the cache cost ~15 us a layer per 16k tokens on the H200.
        rowwise.rope_store(
            q, k, v, cos, sin, turns, entries, cache.keys[index], cache.values[index],
            rotate_k=True, launch=launch, cache_positions=offsets,
            kv_scales=cache.layer_scales(index),
        )  # fmt: skip
        return packed(q, k, v)

    normed = fused_layers(model, input_ids, attend, fused, matmul, keep=last_index, launch=launch,
                          routes=routes, experts=experts, hidden=_hidden(inputs))  # fmt: skip
    return model.lm_head(normed)


def rope_rows(rope: RopeTable, rotary: torch.Tensor, inputs: tuple | None) -> tuple:
    """(cos table, sin table, each token's row in them) that the fused passes' rope_store
    reads: the RoPE table at the tokens' rotary positions, or, given inputs (hidden, cos,
    sin [N, D]: each token's own turn, images.py), row i for token i."""
    if inputs is None:
        return rope.cos, rope.sin, rotary
    _, cos, sin = inputs
    return cos.contiguous(), sin.contiguous(), torch.arange(cos.shape[0], device=cos.device)


def _hidden(inputs: tuple | None) -> torch.Tensor | None:
    return None if inputs is None else inputs[0]


# -------------------------------------------------------------------------------------------
# Extend: tokens appended to sequences whose earlier K/V are kept in their slots (kept.py)


@torch.no_grad()
def extend_forward(
    model,
    cache: KVCache,
    rope: RopeTable,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    token_slots: torch.Tensor,
    last_index: torch.Tensor,
    chunk_tokens: int = 2048,
    cache_at: tuple | None = None,
    decode_rows: int = 0,
    max_len: int | None = None,
    frozen: torch.Tensor | None = None,
    latent_step: str = "torch",
    fp8_experts=None,
    inputs: tuple | None = None,
) -> torch.Tensor:
    """input_ids/position_ids/token_slots [N]: each sequence's new tokens, contiguous and in
    position order; every token attends to its slot's cache up to its own position (the
    model's own modules, eager). -> logits [len(last_index), V] of the rows at last_index.
    A recurrent layer runs each sequence on from its slot's state (from zeros where it
    starts at position 0); frozen [decode_rows]: decode rows whose state must not move (rows
    the device has finished), their new states to the scratch slot.

    In chunks of tokens, each through every layer before the next: a later token reads the
    K/V an earlier chunk wrote (causal order), and the gathered cache stays bounded. cache_at:
    as prefill_forward's. decode_rows, max_len: extend_forward_triton's (here every token
    attends the same way, over its slot up to its position, so they change nothing).
    latent_step: an MLA layer's absorbed attention, every token a row over its slot
    ("triton": the kernel reads the paged latents in place, no gather; layers/latent.py).
    Each token turns at its cache position plus its slot's rotary shift (RopeTable.
    rotary_positions: mRoPE prompts with images, images.py; 0 elsewhere), or by inputs' cos/sin
    when given: (hidden, cos, sin [N, D]) instead of the ids' embeddings and the table's rows
    (a mixed step's chunks of prompts with images, images.chunk_inputs). fp8_experts: as
    layers/eager.decode_forward_torch's."""
    from hybridflow.engine.layers import mixing
    from hybridflow.engine.layers.eager import cached_attention_torch, layer_fp8_experts
    from hybridflow.engine.layers.latent import latent_cached
    from hybridflow.engine.layers.moe import mlp_torch, route_target, sparse_indices
    from hybridflow.engine.layers.sink import frozen_tokens, sink_extend

    entries, offsets = cache_at or (token_slots, position_ids)
    rotary = rope.rotary_positions(position_ids, token_slots)
    sparse = sparse_indices(model)
    rows = input_ids.shape[0]
    wanted = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    wanted[last_index] = True
    kept = []
    for start in range(0, rows, chunk_tokens):
        ids = input_ids[start : start + chunk_tokens]
        positions = position_ids[start : start + chunk_tokens]
        slots = token_slots[start : start + chunk_tokens]
        chunk_at = entries[start : start + chunk_tokens], offsets[start : start + chunk_tokens]
        max_len = int(positions.max()) + 1
        if inputs is None:
            hidden = model.model.embed_tokens(ids)
            turns = rotary[start : start + chunk_tokens]
            cos, sin = rope.cos[turns], rope.sin[turns]
        else:
            hidden, cos, sin = (part[start : start + chunk_tokens] for part in inputs)
        target = route_target(cache, *chunk_at)
        sequences = None
        if cache.states is not None:  # the chunk's sequences, the frozen decode rows' targets
            layout, sequence_slots, fresh = mixing.packed_layout(slots, positions)
            held = None
            if frozen is not None and start < decode_rows:
                held = torch.zeros_like(fresh)
                rows_here = min(decode_rows - start, len(held))
                held[:rows_here] = frozen[start : start + rows_here]
            targets = mixing.write_slots(sequence_slots, held, cache.states.scratch_slot)
            sequences = (layout, sequence_slots, targets, fresh)
        held_tokens = frozen_tokens(frozen, decode_rows, start, ids.shape[0])
        for index, layer in enumerate(model.model.layers):
            normed = layer.input_layernorm(hidden)
            if layer.spec.recurrent:
                out = mixing.recurrent_extend(layer, normed, sequences[0], cache.states, index,
                                              *sequences[1:])  # fmt: skip
            elif layer.spec.mixer == "sink_attention":
                out = sink_extend(layer, normed, cos, sin, cache, index, chunk_at, slots,
                                  positions, max_len, held_tokens)  # fmt: skip
            elif layer.spec.cache == "latent":
                out = latent_cached(layer, normed, cos, sin, cache, index, chunk_at, slots,
                                    positions + 1, max_len, latent_step)  # fmt: skip
            else:
                row = cache.kv_row(index)

                def store(k, v, row=row, chunk_at=chunk_at):
                    cache.store(row, *chunk_at, k, v)

                def attend(q, k, v, row=row, slots=slots, positions=positions, max_len=max_len):
                    return cached_attention_torch(q, *cache.layer(row), slots, positions + 1,
                                                  max_len, cache)  # fmt: skip

                out = mixing.kv_mixer(layer, normed, cos, sin, store, attend)
            hidden = hidden + out
            normed = layer.post_attention_layernorm(hidden)
            hidden = hidden + mlp_torch(layer, normed, target, sparse[index],
                                        fp8=layer_fp8_experts(fp8_experts, index))  # fmt: skip
        kept.append(hidden[wanted[start : start + chunk_tokens]])
    return model.lm_head(model.model.norm(torch.cat(kept)))


@torch.no_grad()
def extend_forward_triton(
    model,
    cache: KVCache,
    rope: RopeTable,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    token_slots: torch.Tensor,
    last_index: torch.Tensor,
    fused: FusedProjections | None = None,
    matmul=None,
    launch: Launch = PLAIN,
    autotune: bool = True,
    attention_kernel: str = "auto",
    spans: tuple | None = None,
    cache_at: tuple | None = None,
    experts=None,
    decode_rows: int = 0,
    max_len: int | None = None,
    inputs: tuple | None = None,
) -> torch.Tensor:
    """extend_forward with the fused kernels: RoPE and the cache store of every new token
    first (rope_store), then the new tokens' attention over their slots, two launches, so no
    program reads a position another program of the same launch writes.

    The attention: on CUDA in 16-bit, FlashAttention's varlen kernel over each sequence's
    whole K/V gathered from its slot (the causal mask aligned bottom-right: new token i of a
    sequence sees the cached prefix and new tokens up to i), so a sequence's K/V is read once
    for all its new tokens. Elsewhere, each token as a decode row over its slot
    (decode_attention), which re-reads the prefix for every new token: an H200 profile of
    256 agent turns of 33 new tokens spent ~60 ms a pass there, against ~5 for the prefill of
    as many tokens. attention_kernel: "flash", "decode", or "auto" (flash where it runs). autotune:
    time decode_attention's tile for each new token count (Engine turns it off). spans: the
    flash path's (gather slots, gather positions, cu new, cu all, max new, max all) as
    _sequence_spans returns them, built on the host by the caller (the scheduler knows the
    lengths: deriving them here syncs with the GPU, stalling the host behind a decoding
    chunk); in a paged cache, the gathered entries are blocks and offsets. cache_at: as
    prefill_forward's.

    decode_rows: the first tokens are decode rows (a mixed step, scheduler.py): one new
    token each, attending through decode_attention over their slot (a paged cache's block
    table), whatever the kernel of the rest; the flash path's spans then cover the other
    tokens only. max_len: a host bound on position_ids + 1 over every token (None: read from
    the device, a sync). Each token turns at its cache position plus its slot's rotary shift,
    as extend_forward's, or by inputs' cos/sin (extend_forward's inputs)."""
    from hybridflow.engine.kernels import attention, rowwise
    from hybridflow.engine.layers.moe import route_target
    from hybridflow.engine.layers.split import fused_layers

    routes = route_target(cache, *(cache_at or (token_slots, position_ids)))
    if attention_kernel not in ("auto", "flash", "decode"):
        raise ValueError(f"attention_kernel={attention_kernel!r}: auto, flash or decode")
    if attention_kernel == "flash" and cache.scales is not None:
        raise ValueError("attention_kernel='flash' reads model-dtype K/V; an FP8 cache's "
                         "extend runs decode attention (auto or decode)")  # fmt: skip
    flash = (
        attention_kernel == "flash"
        or attention_kernel == "auto"
        and (
            input_ids.device.type == "cuda" and cache.keys.dtype in (torch.float16, torch.bfloat16)
        )
    )
    entries, offsets = cache_at or (token_slots, None)
    cos, sin, rotary = rope_rows(rope, rope.rotary_positions(position_ids, token_slots), inputs)
    if offsets is None and rotary is not position_ids:  # stored at the cache position
        offsets = position_ids
    lengths = position_ids + 1
    if max_len is None:
        max_len = int(position_ids.max()) + 1
    decoded = decode_rows if flash else input_ids.shape[0]  # tokens through decode_attention
    if flash:
        if spans is None:
            spans = _sequence_spans(position_ids, token_slots, last_index)
            spans = (*cache.locate(*spans[:2]), *spans[2:])
        gather_slots, gather_positions, cu_new, cu_all, max_new, max_all = spans

    def attend(index, q, k, v):
        keys, values = cache.keys[index], cache.values[index]
        scales = cache.layer_scales(index)
        rowwise.rope_store(q, k, v, cos, sin, rotary, entries, keys, values, launch=launch,
                           cache_positions=offsets, kv_scales=scales)  # fmt: skip
        parts = []
        if decoded:
            parts.append(attention.decode_attention(
                q[:decoded], keys, values, token_slots[:decoded], lengths[:decoded], max_len,
                launch=launch, autotune=autotune, table=cache.block_table, kv_scales=scales,
            ))  # fmt: skip
        if flash:
            parts.append(torch.ops.aten._flash_attention_forward(
                q[decoded:], keys[gather_slots, gather_positions],
                values[gather_slots, gather_positions], cu_new, cu_all, max_new, max_all, 0.0,
                True, False,
            )[0])  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    normed = fused_layers(model, input_ids, attend, fused, matmul, keep=last_index, launch=launch,
                          routes=routes, experts=experts, hidden=_hidden(inputs))  # fmt: skip
    return model.lm_head(normed)


def host_spans(slots: torch.Tensor, cached: torch.Tensor, new: torch.Tensor) -> tuple:
    """What _sequence_spans derives, from the host's per-sequence slots, cached and new token
    counts (CPU int64 tensors): (gather slots, gather positions, cu new, cu all) as CPU
    tensors to upload, and (max new, max all) as ints."""
    from hybridflow.engine.host import ranges

    totals = cached + new
    zero = torch.zeros(1, dtype=torch.int64)
    tensors = (torch.repeat_interleave(slots, totals), ranges(totals),
               torch.cat([zero, new.cumsum(0)]), torch.cat([zero, totals.cumsum(0)]))  # fmt: skip
    return tensors, (int(new.max()), int(totals.max()))


def _sequence_spans(position_ids, token_slots, last_index):
    """Per extended sequence (its new tokens end at last_index): the (slot, position) of every
    cache entry it attends over, in order, and the varlen attention's cumulative lengths and
    maxima of new and of all tokens (one host sync, for the sizes)."""
    slots = token_slots[last_index]
    totals = position_ids[last_index] + 1  # cached + new tokens of each sequence
    ends = last_index + 1
    news = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = torch.stack([totals.sum(), news.max(), totals.max()]).tolist()
    total, max_new, max_all = (int(x) for x in sizes)
    gather_slots = torch.repeat_interleave(slots, totals, output_size=total)
    starts = torch.cumsum(totals, 0) - totals
    gather_positions = torch.arange(total, device=totals.device) - torch.repeat_interleave(
        starts, totals, output_size=total
    )
    zero = ends.new_zeros(1, dtype=torch.int32)
    cu_new = torch.cat([zero, ends.to(torch.int32)])
    cu_all = torch.cat([zero, torch.cumsum(totals, 0).to(torch.int32)])
    return gather_slots, gather_positions, cu_new, cu_all, max_new, max_all
