"""The fp8 rollout's weights quantized with the FP8 trainer's recipe (engine/fp8/weight_scales.py): the e4m3
bytes and scales equal those torchao's float8 training (emulated on the CPU) multiplies by in
a Linear's forward, per recipe and weight dtype, and in the fused q/k/v and gate/up copies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridflow.engine.fp8.matmul import Fp8Matmul
from hybridflow.engine.fp8.weight_scales import quantize_weight, trainer_multiplier
from hybridflow.engine.weights.fused import FusedProjections
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

RECIPES = ("rowwise", "tensorwise")


def _weight(dtype: torch.dtype) -> torch.Tensor:
    """[64, 128] with rows spanning six decades, an outlier, a zero row and values that land
    on e4m3 rounding ties, so that any other scale formula or rounding shows."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 128, generator=generator)
    weight *= torch.logspace(-4, 2, 64)[:, None]
    weight[3, 5] = 900.0  # an outlier: the tensorwise scale is its
    weight[10] = 0.0
    weight[11, :8] = torch.tensor([1.0625, 1.1875, -3.125, 0.0, 2.0**-9, 1e-30, 448.0, 449.0])
    return weight.to(dtype)


def _trainer_weight_cast(weight: torch.Tensor, recipe: str, monkeypatch):
    """(e4m3 [N, K], scale [N, 1]) torchao's Float8Linear casts ``weight`` to in its forward
    (the fp8 training path: learners/fp8_training.float8_config, emulated), with the scale its
    matmul multiplies by (1 / torchao's multiplier, per output channel)."""
    float8 = pytest.importorskip("torchao.float8")
    import torchao.float8.float8_linear as float8_linear
    from torchao.float8.float8_training_tensor import GemmInputRole

    from hybridflow.learners.fp8_training import Fp8Training, float8_config

    linear = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    linear[0].weight = nn.Parameter(weight.clone())
    config = float8_config(Fp8Training(recipe=recipe, emulate=True), fsdp=False)
    float8.convert_to_float8_training(linear, config=config)
    cast = float8_linear.hp_tensor_to_float8_dynamic
    seen = []

    def recording(tensor, *args, **kwargs):
        out = cast(tensor, *args, **kwargs)
        if kwargs.get("gemm_input_role") is GemmInputRole.WEIGHT:
            seen.append(out)
        return out

    monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", recording)
    with torch.no_grad():
        linear(torch.randn(4, weight.shape[1], dtype=weight.dtype))
    (weight_t,) = seen  # [K, N]: the forward casts weight.t()
    scale = weight_t._scale.reciprocal()  # what float8_ops hands torch._scaled_mm
    return weight_t._data.t(), scale.reshape(-1, 1).expand(weight.shape[0], 1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_engine_quantizes_a_weight_to_the_bytes_and_scales_of_the_trainers_forward(
    recipe, dtype, monkeypatch
):
    weight = _weight(dtype)
    trainer_values, trainer_scale = _trainer_weight_cast(weight, recipe, monkeypatch)
    values, scale = quantize_weight(weight, recipe)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert _same_bits(values, trainer_values)
    assert torch.equal(scale, trainer_scale)
    # the engine's own scales are another quantization: the same weight, other bytes
    engine_values, engine_scale = quantize_weight(weight, "engine")
    assert not torch.equal(engine_scale, scale)
    assert not _same_bits(engine_values, values)


def test_rowwise_scales_are_powers_of_two_and_tensorwise_one_per_tensor():
    amax = torch.tensor([[3.0], [448.0], [0.0], [1e-3]])
    rowwise = trainer_multiplier(amax, "rowwise")
    assert torch.equal(rowwise, torch.exp2(torch.log2(rowwise).round()))
    assert torch.equal(rowwise[:2, 0], torch.tensor([128.0, 1.0]))  # 448/3 = 149.3 -> 128
    tensorwise = trainer_multiplier(amax, "tensorwise")
    assert tensorwise[0, 0] == torch.tensor(448.0 / 3.0, dtype=torch.float32)
    with pytest.raises(ValueError, match="must be one of rowwise, tensorwise"):
        trainer_multiplier(amax, "blockwise")
    _, scale = quantize_weight(_weight(torch.float32), "tensorwise")
    assert scale.shape == (64, 1) and (scale == scale[0]).all()


def _model():
    model = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return model


@pytest.mark.parametrize("recipe", RECIPES)
def test_fused_copies_carry_each_source_weights_own_bytes_and_scales(recipe):
    model = _model()
    fused = FusedProjections(model, gate_up=True, fold=False)
    matmul = Fp8Matmul(model, fused, weight_scales=recipe)
    layer = model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    _, qkv8, qkv_scale = matmul.copies[fused.qkv_weight[1].data_ptr()]
    rows = 0
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        values, scale = quantize_weight(proj.weight, recipe)
        part = slice(rows, rows + proj.weight.shape[0])
        assert _same_bits(qkv8[part], values) and torch.equal(qkv_scale[0, part], scale[:, 0])
        rows += proj.weight.shape[0]
    _, pairs8, pairs_scale = matmul.copies[fused.gate_up_weight[1].data_ptr()]
    for offset, proj in enumerate((mlp.gate_proj, mlp.up_proj)):  # interleaved rows
        values, scale = quantize_weight(proj.weight, recipe)
        assert _same_bits(pairs8[offset::2], values)
        assert torch.equal(pairs_scale[0, offset::2], scale[:, 0])
    if recipe == "tensorwise":  # q and k keep their own scales in one copy
        assert qkv_scale[0, 0] != qkv_scale[0, -1]


def test_the_trainers_scales_refuse_norm_weights_folded_into_the_copies():
    model = _model()
    with pytest.raises(ValueError, match="must not fold the norm weights"):
        Fp8Matmul(model, FusedProjections(model, gate_up=True), weight_scales="rowwise")
    unfolded = FusedProjections(model, gate_up=True, fold=False)
    assert not unfolded.folded
    q_proj = model.model.layers[0].self_attn.q_proj
    assert torch.equal(unfolded.qkv_weight[0][: unfolded.q_size], q_proj.weight)  # as it is
