"""kernels/latent_rope.py: an MLA layer's decode rows in one launch (q's rope part turned in
place, the latent normed, the rope key turned, both stored at each row's cache entry and
offset) against the model's modules (mla.project_q, project_latent and the indexed store),
interleaved rope pairs (DeepSeek-V3's) and half-split ones, fp32; bf16 on CUDA (gpu-marked).
Runs on CUDA, or on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine.kernels.latent_rope import latent_rope_store  # noqa: E402
from hybridflow.models.mixers.mla import MultiHeadLatentAttention  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402
from hybridflow.models.rope import rope_cos_sin  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _mixer(interleaved: bool, dtype: torch.dtype, q_lora: bool):
    config = preset_config("tiny-deepseek-v3").replace(
        rope_interleave=interleaved, q_lora_rank=32 if q_lora else None)  # fmt: skip
    mixer = MultiHeadLatentAttention(config)
    generator = torch.Generator().manual_seed(2)
    for p in mixer.parameters():
        p.data = torch.randn(p.shape, generator=generator) * 0.3
    return config, mixer.to(DEVICE, dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half-split"])
def test_one_launch_turns_norms_and_stores_as_the_models_modules(interleaved, dtype):
    config, mixer = _mixer(interleaved, dtype, q_lora=not interleaved)
    rows = 5
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(rows, config.hidden_size, generator=generator).to(DEVICE, dtype)
    positions = torch.tensor([0, 7, 3, 30, 12], device=DEVICE)
    cos, sin = rope_cos_sin(config, positions, dtype)
    width = mixer.kv_lora_rank + mixer.rope_dim
    entries = torch.tensor([4, 0, 2, 1, 3], device=DEVICE)
    offsets = torch.tensor([1, 6, 0, 3, 7], device=DEVICE)
    want_q = mixer.project_q(x, cos, sin)
    latent, k_rope = mixer.project_latent(x, cos, sin)
    want_cache = torch.zeros(6, 8, width, dtype=dtype, device=DEVICE)
    want_cache[entries, offsets] = torch.cat((latent, k_rope), dim=-1)
    projected = mixer.q_proj(x) if mixer.q_lora_rank is None else mixer.q_b_proj(
        mixer.q_a_layernorm(mixer.q_a_proj(x)))  # fmt: skip
    q = projected.unflatten(-1, (mixer.num_heads, mixer.qk_dim))
    cache = torch.zeros_like(want_cache)
    latent_rope_store(q, mixer.kv_a_proj_with_mqa(x), mixer.kv_a_layernorm, cos, sin, cache,
                      entries, offsets, mixer.nope_dim, interleaved)  # fmt: skip
    # fp32: the norm's sum in another order; bf16: its product by the weight rounded once, and
    # on CUDA the rope's FMA: a bf16 step of the terms (|k| < 1) where they cancel to near 0
    # (measured on an H100: 0.0016 at a value of 0.03)
    tolerance = (
        dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2**-8)
    )
    # the rope's roundings are the model's; CUDA contracts the rotation's multiply-add into one
    # FMA, so there q may differ by one rounding: an fp32 ulp, or a bf16 step of |q| < 4
    # (measured on an H100: 4.8e-7 and 0.0156 at most)
    exact = (
        dict(rtol=0, atol=0)
        if DEVICE != "cuda"
        else (dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=2**-6))
    )
    torch.testing.assert_close(q, want_q, **exact)
    torch.testing.assert_close(cache, want_cache, **tolerance)
