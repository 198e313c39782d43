"""The lean decode layers (lean.py): RMSNorm's 1/rms taken inside decode attention and SiLU*up,
residual adds inside cuBLAS. CUDA (marked gpu) or CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.kernels import attention, rowwise
from hybridflow.engine.layers import lean
from hybridflow.engine.options import LEAN_VARIANTS
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402
from hybridflow.models.rope import rope_cos_sin  # noqa: E402


def _rstd(residual, eps):
    return torch.rsqrt(residual.float().pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_attention_norm_equals_scaling_the_projections_first(splits, with_bias, monkeypatch):
    """norm=(residual, eps, bias): q/k/v scaled by each row's 1/rms(residual) plus the bias
    inside the kernel give what the kernel gives for q/k/v scaled and biased beforehand
    (output, stored k and v). A wrong row's rstd, a missing or misplaced bias (q vs k vs v
    heads) or an unscaled v would all differ."""
    monkeypatch.setattr(attention._decode_attention_tuned, "cache", {})
    config = preset_config("tiny")
    rows, heads, kv_heads, dim, seq, hidden = 4, 6, 2, 16, 70, 48  # hidden: not a power of 2
    raw = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=DEVICE) * 4
    residual = torch.randn(rows, hidden, device=DEVICE) * torch.tensor([[0.5], [2], [8], [1]],
                                                                       device=DEVICE)  # fmt: skip
    bias = torch.randn(raw.shape[1], device=DEVICE) if with_bias else None
    eps = 1e-6
    scaled = raw * _rstd(residual, eps) + (bias if with_bias else 0)

    def views(qkv):
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return [t.unflatten(-1, (-1, dim)) for t in (q, k, v)]

    cos, sin = rope_cos_sin(config, torch.arange(seq, device=DEVICE), torch.float32)
    slots = torch.tensor([2, 0, 1, 3], device=DEVICE)
    positions = torch.tensor([3, 0, 24, 69], device=DEVICE)
    keys = torch.randn(5, seq, kv_heads, dim, device=DEVICE)
    values = torch.randn(5, seq, kv_heads, dim, device=DEVICE)
    keys_ref, values_ref = keys.clone(), values.clone()
    expected = attention.decode_attention_rope(
        *views(scaled), cos, sin, positions, keys_ref, values_ref, slots, seq, splits=splits
    )
    got = attention.decode_attention_rope(
        *views(raw), cos, sin, positions, keys, values, slots, seq, splits=splits,
        norm=(residual, eps, bias),
    )  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(keys, keys_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, values_ref, rtol=1e-5, atol=1e-5)


def test_silu_pairs_norm_scales_gate_and_up():
    rows, inner, hidden = 5, 300, 40
    product = torch.randn(rows, 2 * inner, device=DEVICE) * 3
    residual = torch.randn(rows, hidden, device=DEVICE) * torch.arange(1, rows + 1,
                                                                       device=DEVICE)[:, None]  # fmt: skip
    got = rowwise.silu_mul_pairs(product, norm=(residual, 1e-5))
    scaled = product * _rstd(residual, 1e-5)
    gate, up = scaled[:, 0::2], scaled[:, 1::2]
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def _model(seed=1):
    model = build_model(preset_config("tiny"), seed=seed, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    return model


@pytest.mark.parametrize("variant", LEAN_VARIANTS)
def test_lean_engine_matches_eager_engine(variant, monkeypatch):
    """Whole generations (n = 2, filters, fp32 tiny model with a qkv bias) through the lean
    layers equal the eager torch engine's tokens, log-probs within 1e-4; the lean layers
    must have run (counted), not the split path."""
    calls = []
    real = lean.lean_layers
    monkeypatch.setattr(lean, "lean_layers", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    model = _model()
    prompts = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7]]
    # 4 new tokens: the 6 samples still outnumber the 4 slots (rows retire and refill) and
    # every token is a decode step through the fused path (the interpreter's cost)
    params = SamplingParams(n=2, temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=4, seed=3)
    options = EngineOptions(decode_backend="triton", decode_layer=f"lean:{variant}")
    fast = Engine(model, max_batch_size=4, max_seq_len=64, options=options)
    eager = Engine(model, max_batch_size=6, max_seq_len=64,
                   options=EngineOptions(decode_backend="torch", cuda_graphs=False))  # fmt: skip
    a, b = fast.generate(prompts, params), eager.generate(prompts, params)
    assert calls and set(calls) == {variant}
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


def test_lean_does_not_apply_without_folded_gate_up_or_with_qk_norms():
    from hybridflow.engine.weights.fused import FusedProjections

    model = _model()
    assert lean.applies(model, FusedProjections(model, gate_up=True))
    assert not lean.applies(model, FusedProjections(model, gate_up=False))
    assert not lean.applies(model, None)
    config = preset_config("tiny")
    config.qk_norm = True
    qwen3 = build_model(config, seed=0, device=DEVICE)
    assert not lean.applies(qwen3, FusedProjections(qwen3, gate_up=True))
