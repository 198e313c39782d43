"""Fixtures of the engine's CPU tests."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models import build_model
from hybridflow.models.presets import preset_config


@pytest.fixture(scope="module")
def model():
    """The tiny preset with std-0.3 weights (fp32, CPU): peaked logits, so greedy decoding is
    far from ties and sampling is not uniform. Its own generator: the weights do not depend
    on which tests ran before."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.3, generator=generator)
    return model
