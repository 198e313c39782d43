"""Layer specs: what each family's layers are made of, and LoRA's targets per mixer kind."""

import pytest
import torch

from hybridflow.learners.lora import apply_lora
from hybridflow.models import load_model
from hybridflow.models.layer_spec import LayerSpec, lora_target_modules
from hybridflow.models.presets import PRESETS


def test_specs_of_each_family():
    assert {s for s in PRESETS["tiny"].layer_specs()} == {LayerSpec("attention", "dense")}
    moe = PRESETS["tiny-moe"].layer_specs()  # layer 0 keeps a dense MLP (mlp_only_layers)
    assert [s.mlp for s in moe] == ["dense", "experts", "experts", "experts"]
    hybrid = PRESETS["qwen3.5-35b-a3b"].layer_specs()
    assert [s.cache for s in hybrid[:4]] == ["recurrent", "recurrent", "recurrent", "kv"]
    assert all(s.mlp == "experts_shared" and s.sparse for s in hybrid)
    with pytest.raises(ValueError, match="mixer 'mla' is not one of"):
        LayerSpec("mla", "dense")


def test_lora_targets_follow_the_mixer_kind():
    attention_only = [LayerSpec("attention", "dense")]
    assert lora_target_modules(attention_only, ["q_proj", "o_proj"]) == ["q_proj", "o_proj"]
    hybrid = PRESETS["tiny-hybrid"].layer_specs()
    assert lora_target_modules(hybrid, ["q_proj", "v_proj", "o_proj", "down_proj"]) == [
        "q_proj", "v_proj", "o_proj", "down_proj", "in_proj_qkv", "in_proj_z", "out_proj",
    ]  # fmt: skip


def test_lora_adapts_the_linear_attention_projections():
    model = load_model("tiny-hybrid")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    apply_lora(model, rank=4, alpha=8, target_modules=targets)
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    for projection in ("in_proj_qkv", "in_proj_z", "out_proj"):
        assert f"model.layers.0.linear_attn.{projection}" in adapted
    assert "model.layers.3.self_attn.q_proj" in adapted
    ids = torch.arange(1, 9)
    hidden = model.forward_packed(ids, torch.arange(8), torch.tensor([0, 8]), 8)
    hidden.square().mean().backward()
    lora_b = model.model.layers[0].linear_attn.in_proj_qkv.lora_B["default"].weight
    assert lora_b.grad is not None and lora_b.grad.abs().sum() > 0
