"""Rotary position embeddings in Hugging Face's non-interleaved ("rotate_half") layout."""

from __future__ import annotations

import math

import torch

from hybridflow.models.architecture import ModelArchitecture


def rope_inv_freq(
    config: ModelArchitecture, device: torch.device | str | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with config.rope_scaling applied."""
    return rope_parameters(config, device)[0]


def rope_parameters(
    config: ModelArchitecture, device: torch.device | str | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] fp32, scale applied to cos and sin)."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    rope_type = config.rope_type
    if rope_type == "default":
        return inv_freq, 1.0
    scaling = config.rope_scaling
    factor = float(scaling["factor"])
    if rope_type == "linear":
        # Positions divided by factor == frequencies divided by factor.
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling, factor, config.max_position_embeddings), 1.0
    if rope_type == "yarn":
        return _yarn_parameters(inv_freq, scaling, factor, config)
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


def _yarn_parameters(
    inv_freq: torch.Tensor, scaling: dict, factor: float, config: ModelArchitecture
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, arXiv:2309.00071): frequencies that turn fewer than beta_slow
    times over the original context are interpolated (divided by factor), those that turn more
    than beta_fast times are kept, a linear ramp over dimensions in between; cos/sin are scaled
    by the attention factor 0.1 * ln(factor) + 1 (or the mscale ratio when given)."""
    dim = config.rotary_dim
    base = config.rope_theta
    original = float(
        scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    )

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        # Dimension index whose wavelength fits `rotations` turns into the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(inv_freq.device)  # 1 = extrapolate (original frequency)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


def rope_cos_sin(
    config: ModelArchitecture, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., rotary_dim] for integer positions [...], computed in fp32, cast to
    dtype (rotary_dim = head_dim unless the model turns only part of each head)."""
    inv_freq, scale = rope_parameters(config, position_ids.device)  # [head_dim // 2]
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [..., head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [..., head_dim]
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., n_heads, head_dim] by cos/sin [..., rotary_dim] (broadcast over heads);
    with partial RoPE (rotary_dim < head_dim) the remaining dimensions pass unchanged."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)
