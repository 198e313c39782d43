"""LoRA adapts the language model of a vision-language model, never its vision encoder
(whose MLP shares the language model's projection names)."""

import pytest

from hybridflow.learners.lora import apply_lora
from hybridflow.models import load_model

pytest.importorskip("peft")


def test_lora_leaves_the_vision_encoder_alone():
    model = apply_lora(load_model("tiny-vl"), rank=2, alpha=4.0,
                       target_modules=["q_proj", "gate_proj", "down_proj"])  # fmt: skip
    adapted = [name for name, _ in model.named_parameters() if ".lora_" in name]
    assert adapted and not [name for name in adapted if name.startswith("visual.")]
    assert any("layers.0.mlp.gate_proj.lora_A" in name for name in adapted)
    assert not any(p.requires_grad for p in model.visual.parameters())
