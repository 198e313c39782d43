"""The engine's cached forward over the CausalLM's own parameters, read in place (the triton
path can add FusedProjections: concatenated copies of q/k/v and gate/up, see Engine).

Two passes:
- prefill_forward: packed prompts (no padding) -> K/V written into their cache slots, logits of
  each prompt's last token.
- decode_forward: one token for each of B rows -> K/V appended at each row's position,
  logits [B, V].

Two implementations of the decode layer, same math:
- "torch": the model's own modules (RMSNorm, project_qkv, MLP) + SDPA over the cache. Runs
  anywhere; bitwise the model's arithmetic, which the fp32 log-prob tests rely on.
- "triton": fused kernels (kernels.py, attention_kernels.py) for add+RMSNorm, RoPE+cache
  store, decode attention over the live length only, SiLU*up; cuBLAS for the matmuls. CUDA only (CPU under
  TRITON_INTERPRET=1 for tests). Prefill uses the same kernels around packed attention.
"""

from __future__ import annotations

import functools

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
#
# Only each prompt's last token needs the last layer past its attention: every token's K/V is
# in the cache once the last layer's q/k/v are, and the logits are the last tokens'. So that
# layer's o_proj, MLP and norms run on the last tokens only (per token, so the same values):
# 1/L of the prefill's MLP work saved (L = 24 layers at 0.5b).


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
    layers = model.model.layers
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        q, k, v = attn.project_qkv(layer.input_layernorm(hidden), cos, sin)
        cache.keys[index, token_slots, position_ids] = k
        cache.values[index, token_slots, position_ids] = v
        out = attend(q, k, v).flatten(-2)
        if index + 1 == len(layers):  # the last tokens only: see above
            hidden, out = hidden[last_index], out[last_index]
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden))


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
    shared=None,
) -> torch.Tensor:
    """tokens/positions/row_slots [B] -> logits [B, V]; K/V stored at (row_slots, positions).

    max_len: positions read by attention (a static bound under CUDA graphs, the live maximum
    in eager mode). shared (the triton path's shared-prefix groups) is ignored: each row
    reads its whole cache, the same values."""
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


class FusedProjections:
    """Concatenated copies of each layer's q/k/v (and optionally gate/up) weights, so a decode
    layer runs one matmul where the model has three (two). gate/up rows are interleaved
    (gate_0, up_0, gate_1, ...) so a matmul epilogue can pair them (gemm.gemm_nt). With gate/up,
    the RMSNorm weight in front of each is folded in (W * w, one rounding): the norms before
    them then skip their weight, and chain.py can scale rows by 1/rms in the matmul's
    epilogue. A transient copy: made when the KV cache is allocated, refreshed from the live
    parameters at every generate() (in place, so captured graphs stay valid), freed by
    Engine.release()."""

    def __init__(self, model, gate_up: bool):
        layers = model.model.layers
        attn, mlp = layers[0].self_attn, layers[0].mlp
        weight = attn.q_proj.weight
        self.q_size = attn.num_heads * attn.head_dim
        self.kv_size = attn.num_kv_heads * attn.head_dim
        rows = self.q_size + 2 * self.kv_size
        like = dict(dtype=weight.dtype, device=weight.device)
        self.qkv_weight = torch.empty(len(layers), rows, weight.shape[1], **like)
        self.qkv_bias = (
            torch.empty(len(layers), rows, **like) if attn.q_proj.bias is not None else None
        )
        self.gate_up_weight = None
        self.folded = gate_up  # the norm weights folded into qkv and gate/up
        if gate_up:
            inner, hidden = mlp.gate_proj.weight.shape
            self.gate_up_weight = torch.empty(len(layers), 2 * inner, hidden, **like)
        self.refresh(model)

    @torch.no_grad()
    def refresh(self, model) -> None:
        """Copy the live parameters in and fold the norm weights: per layer one cat into the
        q/k/v rows (one more for the biases) and one stack into the interleaved gate/up
        rows, then one fold per stacked tensor.

        Why this shape (H200, engine/NOTES.md runs 13 and 15): a per-layer loop of ~300 small
        ops left the GPU idle between them at the start of every generate(); one list copy
        (torch._foreach_copy_) of all slices took 3-4.5 ms of host time at 0.5b and 1.5b
        (one launch per tensor: strided gate/up targets, and even with those taken out
        3 ms), where a cat or stack per layer is one vectorised launch; and the fold as a
        broadcast multiply ran at ~0.7 TB/s (4.6 ms at 1.5b; kernels.fold_norm_weights)."""
        for index, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                      out=self.qkv_weight[index])  # fmt: skip
            if self.qkv_bias is not None:
                torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias],
                          out=self.qkv_bias[index])  # fmt: skip
            if self.gate_up_weight is not None:
                pairs = self.gate_up_weight[index].unflatten(0, (-1, 2))  # [I, 2, H]
                torch.stack([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight], dim=1,
                            out=pairs)  # fmt: skip
        layers = model.model.layers
        if self.folded:
            _fold(self.qkv_weight, [layer.input_layernorm.weight for layer in layers])
            if self.gate_up_weight is not None:
                _fold(self.gate_up_weight, [layer.post_attention_layernorm.weight
                                            for layer in layers])  # fmt: skip

    def nbytes(self) -> int:
        tensors = [self.qkv_weight, self.qkv_bias, self.gate_up_weight]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _fold(weights: torch.Tensor, norm_weights: list[torch.Tensor]) -> None:
    """weights[l, n, k] *= norm_weights[l][k] in place. One rounding, as in fp32: an
    elementwise product of bf16 (or fp16) tensors is computed in fp32 and rounded once, and
    the product of two bf16 values is exact in fp32. A Triton kernel on CUDA, torch on the
    CPU (Triton's interpreter rounds fp32 -> bf16 by truncation, so it would not be the
    same weights)."""
    norms = torch.stack(norm_weights)
    if weights.is_cuda:
        from hybridflow.engine.kernels import fold_norm_weights

        fold_norm_weights(weights, norms)
    else:
        weights.mul_(norms[:, None, :])


def fused_layers(
    model,
    cache: KVCache,
    rope: RopeTable,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    attend,
    fused: FusedProjections | None,
    matmul=None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Embedding + every layer with the fused kernels, K/V stored at (slots, positions);
    attend(layer_index, q, k, v) -> [N, nh, D] (q/k unrotated: it applies RoPE and stores k/v
    in the cache) is the only part that differs between prefill (packed causal) and decode
    (cached). matmul: a matmul_choice.DecodeMatmul (None: cuBLAS, with the SiLU*up product in
    its own kernel). keep: the rows whose output is wanted (the last layer past attention
    runs on those only). Returns the final-normed hidden states [N or len(keep), H]."""
    from hybridflow.engine import gemm, kernels

    linear = matmul.linear if matmul is not None else F.linear
    gate_up_silu = matmul.gate_up_silu if matmul is not None else gemm.gate_up_silu_cublas

    layers = model.model.layers
    hidden = model.model.embed_tokens(input_ids)  # [N, H] residual stream, updated in place
    weighted = fused is None or not fused.folded  # else the norm weights are in the matmuls
    normed = kernels.rms_norm(hidden, layers[0].input_layernorm, weighted)
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        if fused is not None:
            bias = fused.qkv_bias[index] if fused.qkv_bias is not None else None
            qkv = linear(normed, fused.qkv_weight[index], bias)
            q, k, v = qkv.split([fused.q_size, fused.kv_size, fused.kv_size], dim=-1)
        else:
            q = linear(normed, attn.q_proj.weight, attn.q_proj.bias)
            k = linear(normed, attn.k_proj.weight, attn.k_proj.bias)
            v = linear(normed, attn.v_proj.weight, attn.v_proj.bias)
        q = q.unflatten(-1, (attn.num_heads, attn.head_dim))  # rows may be strided (fused)
        k = k.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        v = v.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        out = attend(index, q, k, v)  # RoPE, the cache store and attention
        if keep is not None and index + 1 == len(layers):  # see the prefill section above
            out, hidden = out[keep], hidden[keep]
        delta = linear(out.flatten(-2), attn.o_proj.weight, attn.o_proj.bias)
        normed = kernels.add_rms_norm(hidden, delta, layer.post_attention_layernorm, weighted)
        mlp = layer.mlp
        if fused is not None and fused.gate_up_weight is not None:
            act = gate_up_silu(normed, fused.gate_up_weight[index])  # silu(gate) * up
        else:
            act = kernels.silu_mul(
                linear(normed, mlp.gate_proj.weight), linear(normed, mlp.up_proj.weight)
            )
        delta = linear(act, mlp.down_proj.weight)
        if index + 1 < len(layers):
            normed = kernels.add_rms_norm(hidden, delta, layers[index + 1].input_layernorm,
                                          weighted)  # fmt: skip
        else:  # the final norm feeds lm_head, never folded
            normed = kernels.add_rms_norm(hidden, delta, model.model.norm)
    return normed


@torch.no_grad()
def decode_forward_triton(
    model,
    cache: KVCache,
    rope: RopeTable,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    row_slots: torch.Tensor,
    max_len: int,
    fused: FusedProjections | None = None,
    matmul=None,
    chain=None,
    shared=None,
) -> torch.Tensor:
    """Same contract as decode_forward_torch; fused kernels, attention over live lengths only
    (max_len only sizes the split of the sequence among thread blocks). chain: a
    chain.DecodeChain (five launches per layer, the norms inside the matmuls), used where it
    applies and wins (needs fused gate/up weights); it also times and records the lean
    layers (lean.py: cuBLAS matmuls, the norms inside attention and SiLU*up) against both.
    shared: (first [B], groups) of shared_prefix.group_table: each prompt's prefix is read
    once per group of its samples."""
    from hybridflow.engine import attention_kernels, lean, pdl
    from hybridflow.engine.chain import chain_layers

    def attend(index, q, k, v, norm=None):
        return attention_kernels.decode_attention_rope(
            q, k, v, rope.cos, rope.sin, positions, cache.keys[index], cache.values[index],
            row_slots, max_len, norm=norm, shared=shared,
        )  # fmt: skip

    def run_split():
        with pdl.suspended():
            return fused_layers(model, cache, rope, tokens, positions, row_slots, attend, fused,
                                matmul)  # fmt: skip

    def run_chain():
        return chain_layers(model, tokens, attend, fused, chain)

    def run_lean(variant):
        with pdl.suspended():
            return lean.lean_layers(model, tokens, attend, fused, matmul, variant)

    rows = tokens.shape[0]
    candidates = {"split": run_split}
    usable = fused is not None and fused.gate_up_weight is not None
    if usable and chain is not None and chain.applies(rows):
        candidates["chain"] = run_chain
    forced = None
    if lean.MODE != "off" and lean.applies(model, fused):
        for variant in lean.VARIANTS if lean.MODE == "auto" else [lean.MODE]:
            candidates[f"lean:{variant}"] = functools.partial(run_lean, variant)
        forced = None if lean.MODE == "auto" else f"lean:{lean.MODE}"
    if forced is None and chain is not None:
        path = chain.choose(rows, model.config.hidden_size, candidates)
    else:
        path = forced or "split"
    normed = candidates[path]()
    return model.lm_head(normed)


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
) -> torch.Tensor:
    """Same contract as prefill_forward, with the decode step's fused kernels around the
    model's packed attention (reads the rotated keys back from the cache)."""
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

    from hybridflow.engine import kernels

    def attend(index, q, k, v):
        # k rotated in place (a strided view of the qkv product, like q and v): gathering the
        # rotated keys back from the cache cost ~15 us a layer per 16k tokens on the H200.
        kernels.rope_store(
            q, k, v, rope.cos, rope.sin, position_ids, token_slots, cache.keys[index],
            cache.values[index], rotate_k=True,
        )  # fmt: skip
        return packed(q, k, v)

    normed = fused_layers(
        model, cache, rope, input_ids, position_ids, token_slots, attend, fused, matmul,
        keep=last_index,
    )  # fmt: skip
    return model.lm_head(normed)


DECODE_FORWARDS = {"torch": decode_forward_torch, "triton": decode_forward_triton}
