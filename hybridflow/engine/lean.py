"""Decode layers with cuBLAS matmuls and no RMSNorm kernels (six launches a layer).

The split path (forward.fused_layers) runs eight per layer at decode sizes: add+RMSNorm, qkv,
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

MLP variants (both timed where they apply): "silu" as above; "kernel" keeps the add+RMSNorm
before gate/up so a tuned Triton gate/up with SiLU in its epilogue (matmul_choice) can run,
the choice at 0.5b where that matmul beats cuBLAS.

Rounding differs from the split path by where the bf16 roundings fall, not by how many
(checked against the model's forward in tests/engine/test_lean.py). Needs FusedProjections
with gate/up (the folded weights), no o_proj bias and no q/k norms (Qwen3); else the split
path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VARIANTS = ("silu", "kernel")
# "auto": both variants timed against the other decode paths per batch-size bucket
# (chain.DecodeChain.choose); "silu" / "kernel": that variant always, where it applies;
# "off": never. The CLI's --lean sets it for A/B runs.
MODE = "auto"


def applies(model, fused) -> bool:
    attn = model.model.layers[0].self_attn
    return (
        fused is not None
        and fused.gate_up_weight is not None
        and fused.folded
        and attn.o_proj.bias is None
        and attn.q_norm is None
    )


def lean_layers(model, tokens, attend, fused, matmul=None, mlp: str = "silu") -> torch.Tensor:
    """Embedding + every decoder layer; returns the final-normed hidden states [B, H].

    attend(layer_index, q, k, v, norm) -> [B, nh, D] as forward.fused_layers' with the
    attention kernel's norm argument (residual, eps, qkv bias). mlp: "silu" or "kernel"
    (module docstring); matmul: a matmul_choice.DecodeMatmul for "kernel"'s gate/up."""
    from hybridflow.engine import gemm, kernels

    if mlp not in VARIANTS:
        raise ValueError(f"lean mlp={mlp!r} not in {VARIANTS}")
    gate_up_silu = matmul.gate_up_silu if matmul is not None else gemm.gate_up_silu_cublas
    hidden = model.model.embed_tokens(tokens)  # [B, H] residual stream, updated in place
    for index, layer in enumerate(model.model.layers):
        attn, mlp_module = layer.self_attn, layer.mlp
        qkv = F.linear(hidden, fused.qkv_weight[index])  # the bias comes after the scaling
        q, k, v = qkv.split([fused.q_size, fused.kv_size, fused.kv_size], dim=-1)
        q = q.unflatten(-1, (attn.num_heads, attn.head_dim))
        k = k.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        v = v.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        bias = fused.qkv_bias[index] if fused.qkv_bias is not None else None
        out = attend(index, q, k, v, (hidden, layer.input_layernorm.eps, bias))
        eps = layer.post_attention_layernorm.eps
        if mlp == "silu":
            hidden.addmm_(out.flatten(-2), attn.o_proj.weight.t())
            product = F.linear(hidden, fused.gate_up_weight[index])
            act = kernels.silu_mul_pairs(product, norm=(hidden, eps))
        else:
            delta = F.linear(out.flatten(-2), attn.o_proj.weight)
            normed = kernels.add_rms_norm(hidden, delta, layer.post_attention_layernorm,
                                          weighted=False)  # fmt: skip
            act = gate_up_silu(normed, fused.gate_up_weight[index])
        hidden.addmm_(act, mlp_module.down_proj.weight.t())
    return kernels.rms_norm(hidden, model.model.norm)
