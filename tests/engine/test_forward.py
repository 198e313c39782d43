"""The engine's eager prefill (forward.py) on CPU, fp32."""

from __future__ import annotations

import torch

from hybridflow.engine.forward import RopeTable, prefill_forward
from hybridflow.engine.kv_cache import allocate_cache
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config


def test_prefill_runs_the_last_layer_past_attention_on_last_tokens_only():
    """The last layer's MLP sees one row per prompt (not every packed token), and the logits
    still equal the model's own forward at each prompt's last position; the K/V of every
    token of the last layer is in the cache."""
    cfg = preset_config("tiny")
    model = build_model(cfg, seed=4).eval().requires_grad_(False)
    lengths = [5, 9, 3]
    prompts = [torch.randint(0, cfg.vocab_size, (n,)) for n in lengths]
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in lengths])
    slots = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    cache = allocate_cache(cfg.num_hidden_layers, 3, 16, cfg.num_key_value_heads, cfg.head_dim,
                           torch.float32, torch.device("cpu"))  # fmt: skip
    rows_seen = {}

    def record(index):
        def hook(module, args, out):  # returns None: the output stays as it is
            rows_seen[index] = args[0].shape[0]

        return hook

    hooks = [
        layer.mlp.register_forward_hook(record(i)) for i, layer in enumerate(model.model.layers)
    ]
    try:
        logits = prefill_forward(model, cache, RopeTable(cfg, 16, torch.float32, ids.device),
                                 ids, positions, slots, cu.to(torch.int32), max(lengths),
                                 cu[1:] - 1)  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    last = cfg.num_hidden_layers - 1
    assert rows_seen[last] == len(lengths)
    assert all(rows_seen[i] == sum(lengths) for i in range(last))
    for i, prompt in enumerate(prompts):
        expected = model(prompt[None])[0, -1]
        torch.testing.assert_close(logits[i], expected, rtol=1e-5, atol=1e-5)
        assert cache.keys[last, i, : lengths[i]].abs().sum() > 0
        assert cache.keys[last, i, lengths[i] :].abs().sum() == 0


def test_fused_projections_refresh_is_the_per_layer_concatenation_with_norms_folded():
    """refresh() (one batched copy, one multiply per tensor) gives bitwise what concatenating
    q/k/v, interleaving gate/up rows and folding each norm weight in fp32 per layer gives, in
    bf16; and a later refresh picks up parameters changed in place (an optimizer step)."""
    from hybridflow.engine.forward import FusedProjections

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
