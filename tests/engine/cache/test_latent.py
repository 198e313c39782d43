"""The latent cache kind (engine/cache/latent.py): which layers keep it, its width, and its
bytes a position, which are what the memory plan prices a token."""

from __future__ import annotations

import torch

from hybridflow.engine.cache.latent import latent_spec
from hybridflow.models.presets import PRESETS


def test_deepseek_v3_keeps_576_values_a_token_in_every_layer():
    arch = PRESETS["deepseek-v3"]
    spec = latent_spec(arch, torch.bfloat16)
    assert spec.layers == tuple(range(61)) and spec.width == 512 + 64
    assert spec.bytes_per_position == 61 * 576 * 2 == arch.kv_bytes_per_token(2)
    assert spec.rows(61) == list(range(61))


def test_models_without_mla_keep_none():
    assert latent_spec(PRESETS["qwen3-30b-a3b"], torch.bfloat16) is None
    assert latent_spec(PRESETS["tiny-hybrid"], torch.bfloat16) is None


def test_allocate_is_zeroed_with_a_row_per_layer():
    spec = latent_spec(PRESETS["tiny-deepseek-v3"], torch.float32)
    latent = spec.allocate(5, 16, torch.device("cpu"))
    assert latent.shape == (3, 5, 16, 40) and not latent.any()
