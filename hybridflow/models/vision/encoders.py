"""The encoder module of a VisionSpec's kind (spec.py lists them)."""

from __future__ import annotations

from torch import nn

from hybridflow.models.vision import qwen2_5_vl, qwen3_5
from hybridflow.models.vision.spec import VisionSpec

ENCODERS = {"qwen2_5_vl": qwen2_5_vl.VisionEncoder, "qwen3_5": qwen3_5.VisionEncoder}


def vision_encoder(spec: VisionSpec) -> nn.Module:
    return ENCODERS[spec.kind](spec)
