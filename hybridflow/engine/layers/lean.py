"""Decode layers with cuBLAS matmuls and the RMSNorms inside other kernels (six launches).

The split layer (split.py) runs eight per layer at decode sizes: add+RMSNorm, qkv,
attention, o_proj, add+RMSNorm, gate/up, SiLU*up, down. Each norm is ~2-3 us of mostly fixed
cost in a graph replay (a launch, a ramp, a drain), 56 of them a step at 1.5b. The chain
(chain.py) removes them by running every matmul in Triton, which loses to cuBLAS at 1.5b and
at 1024 rows. Here the matmuls stay cuBLAS and the norms move into the kernels that already
read each row:

- o_proj and down add their product into the residual stream inside cuBLAS (`addmm_`, beta
  = 1): one rounding of residual + product where the split path rounds the product first;
- qkv and gate/up multiply the residual stream itself, with the RMSNorm weight folded into
  their weights (FusedProjections): residual @ (W * w)^T = rms(residual) * (RMSNorm(residual)
  @ W^T), so the consumer scales each row by 1/rms;
- the consumers take 1/rms from the residual row (a few KB from L2 per program): decode
  attention (attention_kernels NORM: then the qkv bias, then RoPE) and SiLU*up (kernels
  silu_mul_pairs with norm).

Variants (each timed where it applies, as a decode path of its own): which of the layer's
two norms move. "qkv+mlp": both, as above; "qkv": the one in front of qkv only (the MLP keeps
add+RMSNorm, so a tuned Triton gate/up with SiLU in its epilogue can run: matmul_choice);
"mlp": the one in front of gate/up only (attention keeps its plain kernel: on the H200, 1/rms
inside attention cost 2-4 us a layer, as much as the norm kernel it replaces, while inside
SiLU*up it cost nothing).

Rounding differs from the split path by where the bf16 roundings fall, not by how many
(whole generations checked against the eager engine in tests/engine/layers/test_lean.py).
Needs FusedProjections with gate/up (the folded weights), no o_proj bias and no q/k norms
(Qwen3); else the split layer runs. Launched without PDL (its cuBLAS matmuls break every
other link).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.engine.kernels.launch import PLAIN, Launch
from hybridflow.engine.options import LEAN_VARIANTS


def applies(model, fused) -> bool:
    attn = model.model.layers[0].self_attn
    return (
        fused is not None
        and fused.gate_up_weight is not None
        and fused.folded
        and attn.o_proj.bias is None
        and attn.q_norm is None
    )


def lean_layers(
    model, tokens, attend, fused, matmul=None, variant: str = "qkv+mlp", launch: Launch = PLAIN
) -> torch.Tensor:
    """Embedding + every decoder layer; returns the final-normed hidden states [B, H].

    attend(layer_index, q, k, v, norm=None) -> [B, nh, D] as forward.fused_layers' with the
    attention kernel's norm argument (residual, eps, qkv bias). variant: VARIANTS (module
    docstring); matmul: a matmul_choice.DecodeMatmul for the gate/up where the MLP keeps its
    norm kernel; launch: the kernels' launch options."""
    from hybridflow.engine.kernels import gemm, rowwise

    if variant not in LEAN_VARIANTS:
        raise ValueError(f"lean variant={variant!r} not in {LEAN_VARIANTS}")
    in_attention, in_silu = variant != "mlp", variant != "qkv"
    gate_up_silu = matmul.gate_up_silu if matmul is not None else gemm.gate_up_silu_cublas
    layers = model.model.layers
    hidden = model.model.embed_tokens(tokens)  # [B, H] residual stream, updated in place
    normed = (
        None if in_attention else rowwise.rms_norm(hidden, layers[0].input_layernorm, False, launch)
    )
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        bias = fused.qkv_bias[index] if fused.qkv_bias is not None else None
        if in_attention:  # the bias comes after the scaling, in the kernel
            qkv = F.linear(hidden, fused.qkv_weight[index])
        else:
            qkv = F.linear(normed, fused.qkv_weight[index], bias)
        q, k, v = qkv.split([fused.q_size, fused.kv_size, fused.kv_size], dim=-1)
        q = q.unflatten(-1, (attn.num_heads, attn.head_dim))
        k = k.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        v = v.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        if in_attention:
            out = attend(index, q, k, v, (hidden, layer.input_layernorm.eps, bias))
        else:
            out = attend(index, q, k, v)
        if in_silu:
            hidden.addmm_(out.flatten(-2), attn.o_proj.weight.t())
            product = F.linear(hidden, fused.gate_up_weight[index])
            act = rowwise.silu_mul_pairs(
                product, (hidden, layer.post_attention_layernorm.eps), launch
            )
        else:
            delta = F.linear(out.flatten(-2), attn.o_proj.weight)
            normed = rowwise.add_rms_norm(hidden, delta, layer.post_attention_layernorm,
                                          weighted=False, launch=launch)  # fmt: skip
            act = gate_up_silu(normed, fused.gate_up_weight[index], launch)
        down = layer.mlp.down_proj.weight
        if in_attention:
            hidden.addmm_(act, down.t())
        elif index + 1 < len(layers):
            normed = rowwise.add_rms_norm(hidden, F.linear(act, down),
                                          layers[index + 1].input_layernorm, weighted=False,
                                          launch=launch)  # fmt: skip
        else:  # the final norm feeds lm_head, never folded
            return rowwise.add_rms_norm(
                hidden, F.linear(act, down), model.model.norm, launch=launch
            )
    return rowwise.rms_norm(hidden, model.model.norm, launch=launch)
