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
    deepseek = PRESETS["deepseek-v3"].layer_specs()  # the first 3 layers dense
    assert [(s.mixer, s.mlp, s.cache) for s in deepseek[2:4]] == [
        ("mla", "dense", "latent"), ("mla", "grouped_experts_shared", "latent")]  # fmt: skip
    gpt_oss = PRESETS["gpt-oss-20b"].layer_specs()
    assert [(s.mixer, s.window) for s in gpt_oss[:2]] == [("sink_attention", 128),
                                                         ("sink_attention", 0)]  # fmt: skip
    with pytest.raises(ValueError, match="mixer 'mamba' is not one of"):
        LayerSpec("mamba", "dense")


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


def test_lora_adapts_mlas_projections():
    model = load_model("tiny-deepseek-v3")
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    for projection in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert f"model.layers.0.self_attn.{projection}" in adapted
