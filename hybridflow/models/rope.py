"""Rotary position embeddings in Hugging Face's non-interleaved ("rotate_half") layout."""

from __future__ import annotations

import math

import torch

from hybridflow.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with config.rope_scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    rope_type = config.rope_type
    if rope_type == "default":
        return inv_freq
    scaling = config.rope_scaling
    factor = float(scaling["factor"])
    if rope_type == "linear":
        # Positions divided by factor == frequencies divided by factor.
        return inv_freq / factor
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling, factor, config.max_position_embeddings)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}")


def _llama3_inv_freq(
    inv_freq: torch.Tensor, scaling: dict, factor: float, max_positions: int
) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed by factor, short kept,
    a linear blend in between (Meta's reference llama3 apply_scaling)."""
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", max_positions))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    blend = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * slowed / factor + blend * slowed
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, slowed)


def rope_cos_sin(
    config: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., head_dim] for integer positions [...], computed in fp32, cast to dtype."""
    inv_freq = rope_inv_freq(config, position_ids.device)  # [head_dim // 2]
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [..., head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [..., head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., n_heads, head_dim] by cos/sin [..., head_dim] (broadcast over heads)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin
