"""The tiny GPT-OSS the engine's tests decode (CPU, the kernel tests, the GPU test)."""

import torch

from hybridflow.models import build_model
from hybridflow.models.presets import preset_config


def gpt_oss_model(seed: int = 1):
    """tiny-gpt-oss (a sliding layer of 8 tokens, then a full one) with std-0.3 weights,
    sinks and biases (fp32): peaked logits, greedy far from ties, the sinks taking a visible
    share of each softmax."""
    generator = torch.Generator().manual_seed(seed)
    model = build_model(preset_config("tiny-gpt-oss"), seed=seed).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model
