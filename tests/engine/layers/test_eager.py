"""The eager decode step's attention of K/V layers (layers/eager.py) through the Triton decode
kernel (attention_step="triton": the cache read in place) against the torch form (the rows'
K/V gathered, SDPA): tiny-hybrid's gated-attention layer, slot and paged caches. Runs on CUDA
(marked gpu), or on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions  # noqa: E402
from hybridflow.engine.layers import eager  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402


@pytest.mark.parametrize("block", [None, 16], ids=["slot", "paged"])
def test_kv_layers_attend_through_the_kernel_on_the_cache_in_place(block, monkeypatch):
    model = build_model(preset_config("tiny-hybrid"), seed=1).to(DEVICE).eval()
    model.requires_grad_(False)
    options = EngineOptions(decode_backend="torch", cuda_graphs=False, kv_block_size=block)
    engine = Engine(model, 3, 32, options=options)
    assert engine.num_slots >= 3  # allocates the cache
    cache = engine.cache
    generator = torch.Generator(DEVICE).manual_seed(0)
    for kv in (cache.keys, cache.values):
        kv.copy_(torch.randn(kv.shape, generator=generator, device=DEVICE))
    tokens = torch.tensor([5, 9, 3], device=DEVICE)
    positions = torch.tensor([4, 17, 0], device=DEVICE)
    slots = torch.tensor([2, 0, 1], device=DEVICE)

    def step(attention):
        cache.states.conv.zero_()
        cache.states.ssm.zero_()
        return eager.decode_forward_torch(model, cache, engine.rope, tokens, positions, slots,
                                          cache.max_seq_len, attention_step=attention)  # fmt: skip

    want = step("torch")

    def gathered(*args, **kwargs):
        raise AssertionError("the triton attention step gathered the rows' K/V")

    monkeypatch.setattr(eager, "cached_attention_torch", gathered)
    torch.testing.assert_close(step("triton"), want, rtol=1e-4, atol=1e-4)
