"""The split decode layer: eight launches a layer at decode sizes (add+RMSNorm, qkv,
attention, o_proj, add+RMSNorm, gate/up (+SiLU), down), cuBLAS for the matmuls (or the
DecodeMatmul's choice for gate/up), the fused row-wise kernels around them. Also the layer
stack of the triton prefill (with its packed attention). The reference the other decode
layers (chain.py, lean.py) are timed against, and the one that always applies, fp8 included:
with an fp8.Fp8Matmul the norms and SiLU*up write e4m3 rows for the projections after them
(a sparse layer's post-attention norm writes model-dtype rows: its router and its experts,
weight-only e4m3 in fp8/experts.py, read those).
On a tensor-parallel shard (engine/tensor_parallel.py) each rank runs it over its heads and
MLP columns, o_proj's and down_proj's partial products summed over the group where the eager
modules sum them (a sparse layer's experts: layers/moe.experts_triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.engine.kernels.launch import PLAIN, Launch


def fused_layers(
    model,
    input_ids: torch.Tensor,
    attend,
    fused,
    matmul=None,
    keep: torch.Tensor | None = None,
    launch: Launch = PLAIN,
    routes=None,
    experts=None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Embedding + every layer with the fused kernels; attend(layer_index, q, k, v) -> [N, nh,
    D] (q/k unrotated: it applies RoPE and stores k/v in the cache) is the only part that
    differs between prefill (packed causal) and decode (cached). fused: weights.
    FusedProjections or None (every weight read in place). matmul: a matmul_choice.
    DecodeMatmul (None: cuBLAS, with the SiLU*up product in its own kernel). keep: the rows
    whose output is wanted (the last layer past attention runs on those only: prefill).
    launch: the kernels' launch options. Mixture-of-experts layers (layers/moe.py): routes,
    a moe.RouteTarget the tokens record their expert ids in (None: not recorded); experts, a
    moe.ExpertMatmuls. hidden: the residual stream's start [N, H] instead of the ids'
    embeddings (prompts with images: the encoder's features at their image tokens,
    engine/images.py); it is updated in place. Returns the final-normed hidden states [N or
    len(keep), H]."""
    from hybridflow.engine.fp8.matmul import Fp8Matmul
    from hybridflow.engine.kernels import gemm, rowwise
    from hybridflow.engine.layers.moe import ExpertMatmuls, experts_triton, is_sparse
    from hybridflow.engine.tensor_parallel import project_out

    linear = matmul.linear if matmul is not None else F.linear
    gate_up_silu = matmul.gate_up_silu if matmul is not None else gemm.gate_up_silu_cublas
    fp8 = isinstance(matmul, Fp8Matmul)
    if fp8:  # outputs as e4m3 rows + scales, what its matmuls read
        rms_norm, add_rms_norm = rowwise.rms_norm_e4m3, rowwise.add_rms_norm_e4m3
        silu_mul = rowwise.silu_mul_e4m3
    else:
        rms_norm, add_rms_norm, silu_mul = rowwise.rms_norm, rowwise.add_rms_norm, rowwise.silu_mul

    layers = model.model.layers
    if hidden is None:
        hidden = model.model.embed_tokens(input_ids)  # [N, H] residual stream, updated in place
    weighted = fused is None or not fused.folded  # else the norm weights are in the matmuls
    normed = rms_norm(hidden, layers[0].input_layernorm, weighted, launch)
    sparse_index = 0  # the routing record's layer axis counts sparse layers only
    for index, layer in enumerate(layers):
        last = index + 1 == len(layers)
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
            q, k = rowwise.qk_norm_(q, k, attn.q_norm, attn.k_norm)
        out = attend(index, q, k, v)  # RoPE, the cache store and attention
        # prefill: the last layer past attention runs on the last tokens only (a sparse one
        # routes every token first: the routing record holds each position's experts)
        trim = keep is not None and last
        if trim and not is_sparse(layer):
            out, hidden = out[keep], hidden[keep]
        delta = project_out(linear, out.flatten(-2), attn.o_proj)  # tensor-parallel: summed
        sparse = is_sparse(layer)
        # the router and the fp8 experts (weight-only) read rows in the model's dtype
        post_norm = rowwise.add_rms_norm if sparse else add_rms_norm
        normed = post_norm(hidden, delta, layer.post_attention_layernorm, weighted, launch)
        mlp = layer.mlp
        if sparse:
            delta = experts_triton(mlp, normed, routes, sparse_index, experts or ExpertMatmuls(),
                                   keep=keep if trim else None, prefill=keep is not None,
                                   fp8=matmul.experts.of(index) if fp8 else None)  # fmt: skip
            sparse_index += 1
            if trim:
                hidden = hidden[keep]
        else:
            if fused is not None and fused.gate_up_weight is not None:
                act = gate_up_silu(normed, fused.gate_up_weight[index], launch)  # silu(g) * up
            else:
                act = silu_mul(linear(normed, mlp.gate_proj.weight),
                               linear(normed, mlp.up_proj.weight), launch)  # fmt: skip
            delta = project_out(linear, act, mlp.down_proj)
        if not last:
            normed = add_rms_norm(hidden, delta, layers[index + 1].input_layernorm, weighted,
                                  launch)  # fmt: skip
        else:  # the final norm feeds lm_head, never folded
            normed = rowwise.add_rms_norm(hidden, delta, model.model.norm, launch=launch)
    return normed
