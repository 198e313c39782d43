"""The Qwen3.5 presets and what the memory plan charges a hybrid model: K/V only in its
attention layers, and one recurrent state (conv + fp32 SSM) per sequence in the others."""

import pytest
import torch
from qwen3_5_helpers import transformers_model

from hybridflow.config import load_config
from hybridflow.models import build_model
from hybridflow.models.plan_shapes import shape_of
from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan import parallel_plan as pp
from hybridflow.trainer.plan.memory_rollout import kv_slot_bytes
from hybridflow.trainer.plan.plan_command import plan_command


@pytest.mark.parametrize(
    "name, total, active",
    [("qwen3.5-0.8b", 0.75e9, 0.75e9), ("qwen3.5-4b", 4.21e9, 4.21e9),
     ("qwen3.5-9b", 8.95e9, 8.95e9), ("qwen3.5-27b", 26.90e9, 26.90e9),
     ("qwen3.5-35b-a3b", 34.66e9, 3.45e9), ("qwen3.5-397b-a17b", 396.35e9, 17.35e9)],
)  # fmt: skip
def test_presets_have_the_published_sizes_without_the_vision_tower(name, total, active):
    a = PRESETS[name]
    assert a.num_parameters() == pytest.approx(total, rel=0.01)
    assert a.num_parameters(active=True) == pytest.approx(active, rel=0.01)
    assert a.kv_layers == a.num_hidden_layers // 4


def test_tiny_hybrid_builds_with_the_counted_parameters_and_runs_packed():
    a = PRESETS["tiny-hybrid"]
    model = build_model(a)
    assert a.num_parameters() == sum(p.numel() for p in model.parameters())
    hidden = model.forward_packed(torch.arange(1, 11), torch.cat([torch.arange(4),
                                  torch.arange(6)]), torch.tensor([0, 4, 10]), 6)  # fmt: skip
    assert hidden.shape == (10, a.hidden_size) and torch.isfinite(hidden).all()


def test_recurrent_layers_keep_a_state_per_sequence_and_no_kv():
    a = PRESETS["qwen3.5-4b"]  # 8 attention layers of 4 KV heads x 256; 24 DeltaNet layers
    assert a.kv_bytes_per_token(2) == 2 * 8 * 4 * 256 * 2
    conv = (2 * 16 * 128 + 32 * 128) * 3 * 2  # q, k, v channels x (kernel - 1), bf16
    ssm = 32 * 128 * 128 * 4  # value heads x Dk x Dv, fp32
    assert a.recurrent_state_bytes(2) == 24 * (conv + ssm)
    assert kv_slot_bytes(a, 1000, 2) == 1000 * a.kv_bytes_per_token(2)
    shape = shape_of(a)
    assert pp.kv_bytes_per_token(shape, 1, 2) == a.kv_bytes_per_token(2)
    assert shape.state_bytes == a.recurrent_state_bytes(2)


def test_config_plan_knows_a_qwen3_5_directory(tmp_path):
    transformers_model(moe=True).save_pretrained(tmp_path)
    out = []
    cfg = load_config(None, [f"model.path={tmp_path}"])
    assert plan_command(cfg, "80GiB", out=out.append) == 0
    assert out[0].startswith(f"memory plan: {tmp_path}")
    assert any("KV cache" in line for line in out)


def test_gradient_checkpointing_recomputes_the_recurrent_layers_exactly():
    def grads(checkpointing: bool) -> dict:
        model = build_model(PRESETS["tiny-hybrid"]).train()
        model.enable_gradient_checkpointing(checkpointing)
        ids, cu = torch.arange(3, 15), torch.tensor([0, 5, 12])
        positions = torch.cat([torch.arange(5), torch.arange(7)])
        model.forward_packed(ids, positions, cu, 7).square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if "linear_attn" in n}

    plain, recomputed = grads(False), grads(True)
    assert plain.keys() == recomputed.keys() and len(plain) == 3 * 9
    for name, grad in plain.items():
        assert torch.allclose(recomputed[name], grad, atol=1e-6), name
