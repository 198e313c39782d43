"""FusedProjections (engine/weights/fused.py) on CPU."""

from __future__ import annotations

import torch

from hybridflow.models import build_model
from hybridflow.models.presets import preset_config


def test_fused_projections_refresh_is_the_per_layer_concatenation_with_norms_folded():
    """refresh() (one batched copy, one multiply per tensor) gives bitwise what concatenating
    q/k/v, interleaving gate/up rows and folding each norm weight in fp32 per layer gives, in
    bf16; and a later refresh picks up parameters changed in place (an optimizer step)."""
    from hybridflow.engine.weights.fused import FusedProjections

    cfg = preset_config("tiny")
    model = build_model(cfg, seed=5).to(torch.bfloat16).eval().requires_grad_(False)
    for layer in model.model.layers:  # norm weights away from 1, so folding shows
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    fused = FusedProjections(model, gate_up=True)

    def expected(index):
        layer = model.model.layers[index]
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        pairs = torch.stack([mlp.gate_proj.weight, mlp.up_proj.weight], dim=1).flatten(0, 1)
        fold = [(qkv, layer.input_layernorm.weight), (pairs, layer.post_attention_layernorm.weight)]
        return [(w.float() * g.float()[None, :]).to(w.dtype) for w, g in fold]

    for index in range(cfg.num_hidden_layers):
        qkv, gate_up = expected(index)
        assert torch.equal(fused.qkv_weight[index], qkv)
        assert torch.equal(fused.gate_up_weight[index], gate_up)
    if fused.qkv_bias is not None:
        attn = model.model.layers[0].self_attn
        bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        assert torch.equal(fused.qkv_bias[0], bias)
    last = cfg.num_hidden_layers - 1
    model.model.layers[last].mlp.up_proj.weight.add_(1.0)
    model.model.layers[last].self_attn.v_proj.weight.mul_(-1.0)
    fused.refresh(model)
    qkv, gate_up = expected(last)
    assert torch.equal(fused.qkv_weight[last], qkv)
    assert torch.equal(fused.gate_up_weight[last], gate_up)
