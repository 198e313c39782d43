"""The DeepSeek-V3 and GPT-OSS presets and what the memory plan charges them: MLA's latent
(kv_lora_rank + qk_rope_head_dim a token and layer), GPT-OSS's sliding layers a window's
worth; config plan reads directories of both families."""

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.models import build_model
from hybridflow.models.plan_shapes import shape_of
from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan import parallel_plan as pp
from hybridflow.trainer.plan.memory_rollout import kv_slot_bytes
from hybridflow.trainer.plan.plan_command import plan_command
from tests.models.mla_moe_helpers import deepseek_transformers, gpt_oss_transformers


@pytest.mark.parametrize(
    "name, total, active",
    [("deepseek-v3", 671.03e9, 37.55e9), ("moonlight-16b-a3b", 15.96e9, 2.91e9),
     ("kimi-k2", 1026.4e9, 32.86e9), ("gpt-oss-20b", 20.91e9, 4.19e9),
     ("gpt-oss-120b", 116.83e9, 5.71e9)],
)  # fmt: skip
def test_presets_have_the_published_sizes(name, total, active):
    """Active counts include both embedding matrices (gpt-oss' model card's 3.6 B / 5.1 B
    leave the input one out: 0.58 B)."""
    a = PRESETS[name]
    assert a.num_parameters() == pytest.approx(total, rel=0.005)
    assert a.num_parameters(active=True) == pytest.approx(active, rel=0.005)


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-gpt-oss"])
def test_tiny_presets_build_with_the_counted_parameters_and_run_packed(name):
    a = PRESETS[name]
    model = build_model(a)
    assert a.num_parameters() == sum(p.numel() for p in model.parameters())
    positions = torch.cat([torch.arange(4), torch.arange(12)])
    hidden = model.forward_packed(torch.arange(1, 17), positions, torch.tensor([0, 4, 16]), 12)
    assert hidden.shape == (16, a.hidden_size) and torch.isfinite(hidden).all()


def test_the_latent_cache_is_a_tenth_of_gqa_bytes():
    v3 = PRESETS["deepseek-v3"]
    assert v3.kv_bytes_per_token(2) == 61 * (512 + 64) * 2
    # the same heads as GQA K/V: 61 layers x 2 x 128 heads x (192 + 128) / 2 wide
    assert v3.kv_bytes_per_token(2) * 10 < 61 * 128 * (192 + 128) * 2
    shape = shape_of(v3)
    assert not shape.kv_cache_splits  # every tensor-parallel rank holds the whole latent
    assert pp.kv_bytes_per_token(shape, 8, 2) == v3.kv_bytes_per_token(2)
    assert kv_slot_bytes(v3, 1000, 2) == 1000 * v3.kv_bytes_per_token(2)


def test_sliding_layers_keep_a_windows_worth():
    a = PRESETS["gpt-oss-20b"]  # 12 full + 12 sliding layers of 8 KV heads x 64, window 128
    per_layer = 2 * 8 * 64 * 2
    assert kv_slot_bytes(a, 4096, 2) == 12 * per_layer * 4096 + 12 * per_layer * 128
    assert kv_slot_bytes(a, 100, 2) == 24 * per_layer * 100  # shorter than the window
    shape = shape_of(a)
    assert (shape.window_layers, shape.window) == (12, 128)
    assert pp.kv_bytes_per_sequence(shape, 1, 2, 4096) == kv_slot_bytes(a, 4096, 2)
    assert pp.kv_bytes_per_sequence(shape, 8, 2, 4096) == kv_slot_bytes(a, 4096, 2) // 8


@pytest.mark.parametrize("write", [deepseek_transformers, gpt_oss_transformers])
def test_config_plan_knows_a_directory_of_each_family(tmp_path, write):
    write(max_position_embeddings=4096).save_pretrained(tmp_path)
    out = []
    cfg = load_config(None, [f"model.path={tmp_path}"])
    assert plan_command(cfg, "80GiB", out=out.append) == 0
    assert out[0].startswith(f"memory plan: {tmp_path}")
    assert any("KV cache" in line for line in out)


def test_mla_activations_count_the_expanded_heads_and_the_shared_experts():
    from hybridflow.trainer.plan.memory_activations import layer_activation_elements

    v3 = PRESETS["deepseek-v3"]
    q = 128 * 192
    kv = (q + 128 * 128) // 2 + 512 + 1536  # k/v widths' mean, the latent, q's rank
    assert layer_activation_elements(v3) == 4 * 7168 + 2 * q + 2 * kv + 4 * 18432
    sparse = layer_activation_elements(v3, True) - (4 * 7168 + 2 * q + 2 * kv)
    assert sparse == 8 * (4 * 2048 + 4 * 7168) + 3 * 256 + 4 * 2048  # + the shared expert
