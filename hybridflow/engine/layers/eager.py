"""The eager decode step: the model's own modules (RMSNorm, project_qkv, MLP) + SDPA over the
cache. Runs anywhere; bitwise the model's arithmetic, which the fp32 log-prob tests rely on.
The engine's torch backend, and the reference the fused layers are tested against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hybridflow.engine.cache.kv_cache import KVCache

if TYPE_CHECKING:
    from hybridflow.engine.rope_table import RopeTable


def cached_attention_torch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    row_slots: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    cache: KVCache | None = None,
) -> torch.Tensor:
    """q [B, nh, D]; keys/values one layer's cache [slots, S, nkv, D]; each row attends to
    positions [0, lengths[b]) of its slot -> [B, nh, D]. Reads max_len positions per row.
    cache: the KVCache the layer's tensors belong to, for a paged one's block table."""
    if cache is not None and cache.paged:
        k = cache.gather(keys, row_slots, max_len).transpose(1, 2)
        v = cache.gather(values, row_slots, max_len).transpose(1, 2)
    else:
        k = keys[row_slots, :max_len].transpose(1, 2)  # [B, nkv, max_len, D]
        v = values[row_slots, :max_len].transpose(1, 2)
    visible = torch.arange(max_len, device=q.device)[None, :] < lengths[:, None]  # [B, max_len]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k,
        v,
        attn_mask=visible[:, None, None, :],
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(2)


def cached_attention_triton(q: torch.Tensor, cache: KVCache, row: int, row_slots: torch.Tensor,
                            lengths: torch.Tensor, max_len: int) -> torch.Tensor:  # fmt: skip
    """cached_attention_torch's result through the Triton decode kernel (kernels/attention.py)
    over K/V row ``row`` of the cache in place: each row's positions read once, where the
    torch form first copies [B, max_len] positions of K and V out (and SDPA's math fallback,
    which a masked GQA call takes, expands them to every query head)."""
    from hybridflow.engine.kernels.attention import decode_attention

    return decode_attention(q.contiguous(), cache.keys[row], cache.values[row], row_slots,
                            lengths, max_len, table=cache.block_table,
                            kv_scales=cache.layer_scales(row))  # fmt: skip


def residual_norm(norm, hidden: torch.Tensor, delta: torch.Tensor | None,
                  step: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(hidden + delta, norm of it); delta None: hidden as it is. step "triton": one launch
    (kernels/rowwise.py: the sum written into hidden in place, an RMSNorm's or a
    ZeroCenteredRMSNorm's fp32 arithmetic), where the model's modules take an add and up to
    five kernels over fp32 copies; "torch" (or a norm of another kind): the model's."""
    from hybridflow.models.norm import RMSNorm, ZeroCenteredRMSNorm

    if step == "triton" and type(norm) in (RMSNorm, ZeroCenteredRMSNorm):
        from hybridflow.engine.kernels import rowwise

        if delta is None:
            return hidden, rowwise.rms_norm(hidden, norm)
        return hidden, rowwise.add_rms_norm(hidden, delta, norm)
    if delta is not None:
        hidden = hidden + delta
    return hidden, norm(hidden)


@torch.no_grad()
def decode_forward_torch(
    model,
    cache: KVCache,
    rope: RopeTable,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    row_slots: torch.Tensor,
    max_len: int,
    shared=None,
    frozen: torch.Tensor | None = None,
    recurrent_step: str = "torch",
    attention_step: str = "torch",
    latent_step: str = "torch",
    norm_step: str = "torch",
    expert_step: str = "torch",
    fp8_experts=None,
) -> torch.Tensor:
    """tokens/positions/row_slots [B] -> logits [B, V]; K/V stored at (row_slots, positions).

    max_len: positions read by attention (a static bound under CUDA graphs, the live maximum
    in eager mode). shared (the triton path's shared-prefix groups) is ignored: each row
    reads its whole cache, the same values. A recurrent layer moves each row's state one
    token on, by slot; frozen [B]: rows whose state must not move (finished, still stepping
    until read back), written to the scratch slot instead. recurrent_step: "torch" or
    "triton" (layers/mixing.recurrent_decode). attention_step: "triton" runs the attention of
    K/V layers (gated attention's too) and sink attention (layers/sink.py) through the Triton
    decode kernel, "torch" in torch. latent_step: an MLA layer's absorbed attention, "torch"
    or "triton" (layers/latent.latent_cached). norm_step: the residual adds and RMSNorms,
    "triton" fused in one launch each (residual_norm). expert_step: a sparse layer's
    experts, "triton" on their grouped kernels (layers/moe.mlp_torch), "torch" the model's.
    fp8_experts: fp8/experts.Fp8Experts, the routed experts' e4m3 copies (the fp8 rollout,
    its projections routed by fp8/linears.py around this call; None: the model's weights)."""
    from hybridflow.engine.layers import mixing
    from hybridflow.engine.layers.latent import latent_cached
    from hybridflow.engine.layers.moe import mlp_torch, route_target, sparse_indices
    from hybridflow.engine.layers.sink import sink_decode

    hidden = model.model.embed_tokens(tokens)  # [B, H]
    rotary = rope.rotary_positions(positions, row_slots)  # mRoPE: shifted (engine/images.py)
    cos, sin = rope.cos[rotary], rope.sin[rotary]  # [B, D]
    lengths = positions + 1
    entries, offsets = cache.locate(row_slots, positions)
    target = route_target(cache, entries, offsets)
    sparse = sparse_indices(model)
    targets = None
    if cache.per_sequence:
        targets = mixing.write_slots(row_slots, frozen, cache.scratch_slot)
    delta = None  # the last MLP's output: the next norm adds it to hidden
    for index, layer in enumerate(model.model.layers):
        hidden, normed = residual_norm(layer.input_layernorm, hidden, delta, norm_step)
        if layer.spec.recurrent:
            out = mixing.recurrent_decode(layer, normed, cache.states, index, row_slots, targets,
                                          recurrent_step)  # fmt: skip
        elif layer.spec.mixer == "sink_attention":
            out = sink_decode(layer, normed, cos, sin, cache, index, (entries, offsets), row_slots,
                              positions, max_len, targets, attention_step == "triton")  # fmt: skip
        elif layer.spec.cache == "latent":
            out = latent_cached(layer, normed, cos, sin, cache, index, (entries, offsets),
                                row_slots, lengths, max_len, latent_step)  # fmt: skip
        else:
            row = cache.kv_row(index)

            def store(k, v, row=row):
                cache.store(row, entries, offsets, k, v)

            def attend(q, k, v, row=row):
                if attention_step == "triton":
                    return cached_attention_triton(q, cache, row, row_slots, lengths, max_len)
                return cached_attention_torch(q, *cache.layer(row), row_slots, lengths, max_len,
                                              cache)  # fmt: skip

            out = mixing.kv_mixer(layer, normed, cos, sin, store, attend)
        hidden, normed = residual_norm(layer.post_attention_layernorm, hidden, out, norm_step)
        delta = mlp_torch(layer, normed, target, sparse[index], expert_step=expert_step,
                          fp8=layer_fp8_experts(fp8_experts, index))  # fmt: skip
    return model.lm_head(residual_norm(model.model.norm, hidden, delta, norm_step)[1])


def layer_fp8_experts(fp8_experts, index: int):
    """Layer ``index``'s e4m3 expert copies (fp8/experts.Fp8Experts.of), or None."""
    return None if fp8_experts is None else fp8_experts.of(index)
