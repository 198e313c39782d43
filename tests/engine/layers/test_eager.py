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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_adds_in_place_and_norms_in_one_launch(dtype):
    """The triton step writes hidden + delta into hidden (the torch step makes a new tensor)
    and returns the model's norm of it, for both norm kinds (Qwen3.5's zero-centered one)."""
    from hybridflow.models.norm import RMSNorm, ZeroCenteredRMSNorm

    generator = torch.Generator(DEVICE).manual_seed(0)
    for kind in (RMSNorm, ZeroCenteredRMSNorm):
        norm = kind(64, 1e-6).to(DEVICE)
        norm.weight.data.normal_(0.5, 0.3, generator=generator)
        norm = norm.to(dtype)
        hidden, delta = (torch.randn(3, 64, device=DEVICE, generator=generator).to(dtype)
                         for _ in range(2))  # fmt: skip
        want_hidden, want = eager.residual_norm(norm, hidden, delta)
        fused_hidden = hidden.clone()
        got_hidden, got = eager.residual_norm(norm, fused_hidden, delta, "triton")
        tolerance = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else {}
        assert got_hidden is fused_hidden  # the sum in place (bf16: the interpreter truncates)
        torch.testing.assert_close(fused_hidden, want_hidden, **tolerance)
        torch.testing.assert_close(got, want, **tolerance)
        torch.testing.assert_close(eager.residual_norm(norm, hidden, None, "triton")[1],
                                   norm(hidden), **tolerance)  # fmt: skip


def test_whole_step_on_the_triton_steps_equals_the_models_arithmetic():
    """tiny-hybrid's decode step with the delta-rule kernels, the attention kernel and the
    fused norms against the model's own modules (fp32): the logits and the states."""
    model = build_model(preset_config("tiny-hybrid"), seed=1).to(DEVICE).eval()
    model.requires_grad_(False)
    engine = Engine(model, 3, 32, options=EngineOptions(decode_backend="torch", cuda_graphs=False))
    assert engine.num_slots >= 3
    cache = engine.cache
    generator = torch.Generator(DEVICE).manual_seed(1)
    for buffer in (cache.keys, cache.values, cache.states.conv, cache.states.ssm):
        buffer.copy_(torch.randn(buffer.shape, generator=generator, device=DEVICE) * 0.5)
    start = [t.clone() for t in (cache.states.conv, cache.states.ssm)]
    tokens, positions = (
        torch.tensor([5, 9, 3], device=DEVICE),
        torch.tensor([4, 17, 0], device=DEVICE),
    )
    slots = torch.tensor([2, 0, 1], device=DEVICE)
    results = {}
    for step in ("torch", "triton"):
        for buffer, value in zip((cache.states.conv, cache.states.ssm), start):
            buffer.copy_(value)
        logits = eager.decode_forward_torch(
            model, cache, engine.rope, tokens, positions, slots, cache.max_seq_len,
            recurrent_step=step, attention_step=step, norm_step=step)  # fmt: skip
        results[step] = (logits, cache.states.conv.clone(), cache.states.ssm.clone())
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
