"""FP8 matmuls (engine/fp8/matmul.py) on the CPU: per-row e4m3 quantization within its rounding step, the
scaled matmul against the model-dtype one, copies refreshed in place from the live weights,
rows quantized ahead (what the e4m3 norms hand over) taken as model-dtype ones, and the
options that cannot run fp8 refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.engine import Engine, EngineOptions
from hybridflow.engine.fp8.e4m3 import E4M3_MAX, Fp8Rows, quantize_rows_reference
from hybridflow.engine.fp8.matmul import Fp8Matmul, scaled_linear
from hybridflow.errors import UserError
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config


def test_rows_quantize_within_e4m3_rounding_and_zero_rows_stay_zero():
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [[0.01], [1.0], [30.0], [1e3], [1.0], [0.0]]
    )
    x8, scale = quantize_rows_reference(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    back = x8.float() * scale
    assert torch.equal(back[5], torch.zeros(256))
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.allclose(x.abs().amax(-1, keepdim=True)[:5], back.abs().amax(-1, keepdim=True)[:5])
    normal = x.abs() >= amax / 64  # e4m3's normal range below the row's maximum
    relative = ((back - x).abs() / x.abs().clamp(min=1e-30))[normal]
    assert relative.max() <= 2**-4 + 1e-6  # 3 mantissa bits: half a step is 1/16
    assert (x8.float().abs() <= E4M3_MAX).all()


def test_scaled_linear_is_close_to_the_model_dtype_matmul():
    generator = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 128, generator=generator), torch.randn(64, 128, generator=generator)
    bias = torch.randn(64, generator=generator)
    w8, w_scale = quantize_rows_reference(w)
    out = scaled_linear(x, w8, w_scale.view(1, -1), bias)
    exact = F.linear(x, w, bias)
    assert out.shape == exact.shape and out.dtype == x.dtype
    assert (out - exact).norm() / exact.norm() < 0.05


def _model():
    model = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return model


def test_copies_cover_every_projection_and_refresh_in_place_from_the_live_weights():
    model = _model()
    matmul = Fp8Matmul(model, fused=None)
    layers = model.model.layers
    assert len(matmul.copies) == 7 * len(layers)  # q, k, v, o, gate, up, down
    weight = layers[0].mlp.down_proj.weight
    _, weight8, scale = matmul.copies[weight.data_ptr()]
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, weight.shape[1], generator=generator)
    before = matmul.linear(x, weight)
    weight.mul_(2.0)  # a training step, in place
    matmul.refresh()
    assert matmul.copies[weight.data_ptr()][1] is weight8  # the same buffers: graphs stay valid
    torch.testing.assert_close(matmul.linear(x, weight), 2 * before, rtol=0.02, atol=1e-3)
    fused_like = torch.randn(
        2, 8, weight.shape[1], generator=generator
    )  # views made afresh at every refresh,
    views = Fp8Matmul(model, fused=None)  # as the fused copies' per-layer slices are
    views.sources_with_parts = lambda: [(w, [w], False) for w in (fused_like[0], fused_like[1])]
    views.refresh()
    buffers = [copy[1] for copy in views.copies.values()]
    fused_like.mul_(3.0)
    views.refresh()
    after = [copy[1] for copy in views.copies.values()]
    assert len(after) == 2 and all(a is b for a, b in zip(after, buffers))  # filled in place
    out, exact = views.linear(x, fused_like[1]), F.linear(x, fused_like[1])
    assert (out - exact).norm() / exact.norm() < 0.1  # the new weights (the old ones: 0.67)
    other = torch.randn(
        5, x.shape[1], generator=generator
    )  # not a projection: the model dtype's matmul
    torch.testing.assert_close(matmul.linear(x, other), F.linear(x, other))


def test_linear_takes_rows_quantized_ahead_as_it_takes_model_dtype_rows():
    model = _model()
    weight = model.model.layers[1].self_attn.o_proj.weight
    x = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(3))
    for fast in (True, False):
        matmul = Fp8Matmul(model, fused=None, fast_accumulation=fast)
        rows = quantize_rows_reference(x)
        assert isinstance(rows, Fp8Rows)
        assert torch.equal(matmul.linear(rows, weight), matmul.linear(x, weight))
    other = torch.randn(5, x.shape[1])  # not a projection: dequantized, model-dtype matmul
    dequantized = (rows.values.float() * rows.scale).to(x.dtype)
    assert torch.equal(matmul.linear(rows, other), F.linear(dequantized, other))


def test_options_that_cannot_run_fp8_are_refused():
    assert EngineOptions(weight_format="fp8", decode_layer="chain").validate()
    assert EngineOptions(weight_format="fp8", decode_backend="torch").validate()
    assert EngineOptions(weight_format="int4").validate()
    assert not EngineOptions(weight_format="fp8").validate()
    with pytest.raises(UserError, match="triton decode backend"):
        Engine(_model(), 4, 32, options=EngineOptions(weight_format="fp8", cuda_graphs=False))


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-deepseek-v3", "tiny-hybrid"])
def test_an_fp8_engine_of_the_eager_layer_kinds_builds_on_the_triton_backend(preset,
                                                                             monkeypatch):  # fmt: skip
    """The layers the engine runs on its eager passes run fp8 there (fp8/linears.py): an
    engine asked for the triton backend takes them, and on the CPU the torch one too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton backend on the CPU
    model = build_model(preset_config(preset), seed=0).eval().requires_grad_(False)
    for backend in ("triton", "auto"):
        options = EngineOptions(weight_format="fp8", decode_backend=backend, cuda_graphs=False)
        engine = Engine(model, 4, 32, options=options)
        assert engine.eager_layers and engine.decode_backend == "torch"
