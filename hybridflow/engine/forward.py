"""The engine's cached forward over the CausalLM's own parameters (read in place, never copied).

Two passes:
- prefill_forward: packed prompts (no padding) -> K/V written into their cache slots, logits of
  each prompt's last token.
- decode_forward: one token for each of B rows -> K/V appended at each row's position,
  logits [B, V].

Two implementations of the decode layer, same math:
- "torch": the model's own modules (RMSNorm, project_qkv, MLP) + SDPA over the cache. Runs
  anywhere; bitwise the model's arithmetic, which the fp32 log-prob tests rely on.
- "triton": fused kernels (kernels.py) for add+RMSNorm, RoPE+cache store, decode attention over
  the live length only, SiLU*up; cuBLAS for the matmuls. CUDA only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.engine.kv_cache import KVCache
from hybridflow.models.attention import make_packed_attention, resolve_backend
from hybridflow.models.rope import rope_cos_sin


class RopeTable:
    """cos/sin [max_seq_len, head_dim] in the model dtype: the same values rope_cos_sin gives
    for each position, computed once instead of every step."""

    def __init__(self, config, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        positions = torch.arange(max_seq_len, device=device)
        self.cos, self.sin = rope_cos_sin(config, positions, dtype)


def lm_head_weight(model) -> torch.Tensor:
    return model.lm_head.weight


# -------------------------------------------------------------------------------------------
# Prefill (packed prompts), eager


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
) -> torch.Tensor:
    """input_ids/position_ids/token_slots [N] (prompts packed), cu_seqlens int32 [P+1],
    last_index [P] (index in N of each prompt's last token) -> logits [P, V] (model dtype).

    Every token's K/V goes to cache[layer, token_slots, position_ids]."""
    hidden = model.model.embed_tokens(input_ids)  # [N, H]
    cos, sin = rope.cos[position_ids], rope.sin[position_ids]  # [N, D]
    backend = resolve_backend(model.attention_backend, hidden.device, hidden.dtype)
    attend = make_packed_attention(backend, cu_seqlens, max_seqlen, input_ids.shape[0])
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = attn.project_qkv(layer.input_layernorm(hidden), cos, sin)
        cache.keys[index, token_slots, position_ids] = k
        cache.values[index, token_slots, position_ids] = v
        hidden = hidden + attn.o_proj(attend(q, k, v).flatten(-2))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    last = model.model.norm(hidden[last_index])  # RMSNorm is per token: only the rows we need
    return model.lm_head(last)


# -------------------------------------------------------------------------------------------
# Decode (one token per row), torch ops


def cached_attention_torch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    row_slots: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """q [B, nh, D]; keys/values one layer's cache [slots, S, nkv, D]; each row attends to
    positions [0, lengths[b]) of its slot -> [B, nh, D]. Reads max_len positions per row."""
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


@torch.no_grad()
def decode_forward_torch(
    model,
    cache: KVCache,
    rope: RopeTable,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    row_slots: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """tokens/positions/row_slots [B] -> logits [B, V]; K/V stored at (row_slots, positions).

    max_len: positions read by attention (a static bound under CUDA graphs, the live maximum
    in eager mode)."""
    hidden = model.model.embed_tokens(tokens)  # [B, H]
    cos, sin = rope.cos[positions], rope.sin[positions]  # [B, D]
    lengths = positions + 1
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = attn.project_qkv(layer.input_layernorm(hidden), cos, sin)
        cache.keys[index, row_slots, positions] = k
        cache.values[index, row_slots, positions] = v
        out = cached_attention_torch(
            q, cache.keys[index], cache.values[index], row_slots, lengths, max_len
        )
        hidden = hidden + attn.o_proj(out.flatten(-2))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden))


# -------------------------------------------------------------------------------------------
# Decode, fused Triton kernels (CUDA)


@torch.no_grad()
def decode_forward_triton(
    model,
    cache: KVCache,
    rope: RopeTable,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    row_slots: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """Same contract as decode_forward_torch; fused kernels, attention over live lengths only
    (max_len only sizes the split of the sequence among thread blocks)."""
    from hybridflow.engine import kernels

    layers = model.model.layers
    hidden = model.model.embed_tokens(tokens)  # [B, H] residual stream, updated in place
    normed = kernels.rms_norm(hidden, layers[0].input_layernorm)
    lengths = positions + 1
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        q = F.linear(normed, attn.q_proj.weight, attn.q_proj.bias)
        k = F.linear(normed, attn.k_proj.weight, attn.k_proj.bias)
        v = F.linear(normed, attn.v_proj.weight, attn.v_proj.bias)
        q = q.view(-1, attn.num_heads, attn.head_dim)
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        kernels.rope_store(
            q, k, v, rope.cos, rope.sin, positions, row_slots, cache.keys[index],
            cache.values[index],
        )  # fmt: skip
        out = kernels.decode_attention(
            q, cache.keys[index], cache.values[index], row_slots, lengths, max_len
        )
        delta = F.linear(out.view(out.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)
        normed = kernels.add_rms_norm(hidden, delta, layer.post_attention_layernorm)
        mlp = layer.mlp
        gated = kernels.silu_mul(
            F.linear(normed, mlp.gate_proj.weight), F.linear(normed, mlp.up_proj.weight)
        )
        delta = F.linear(gated, mlp.down_proj.weight)
        next_norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else None
        normed = kernels.add_rms_norm(hidden, delta, next_norm or model.model.norm)
    return model.lm_head(normed)


DECODE_FORWARDS = {"torch": decode_forward_torch, "triton": decode_forward_triton}
