"""The tiny GPT-OSS the engine's tests decode (CPU, the kernel tests, the GPU test)."""

from dataclasses import replace

import torch

from hybridflow.models import build_model
from hybridflow.models.presets import preset_config


def gpt_oss_model(seed: int = 1, window: int | None = None):
    """tiny-gpt-oss (a sliding layer of 8 tokens, or of ``window``, then a full one) with
    std-0.3 weights, sinks and biases (fp32): peaked logits, greedy far from ties, the sinks
    taking a visible share of each softmax. The weights depend on the seed only."""
    generator = torch.Generator().manual_seed(seed)
    config = preset_config("tiny-gpt-oss")
    if window is not None:
        config = replace(config, attention_window=window)
    model = build_model(config, seed=seed).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model
