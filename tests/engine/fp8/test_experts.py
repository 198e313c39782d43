"""The fp8 rollout's routed experts (engine/fp8/experts.py) on the CPU: each expert row
quantized as the dense copies' quantize_weight quantizes a weight, whatever the chunking;
copies of the sparse layers only, refreshed in place from the live weights; Fp8Matmul holds
them beside the dense layers' projections."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.fp8.experts import Fp8Experts, expert_tensors, quantize_experts_into
from hybridflow.engine.fp8.matmul import Fp8Matmul
from hybridflow.engine.fp8.weight_scales import quantize_weight
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config


def _moe_model():
    model = build_model(preset_config("tiny-moe"), seed=2).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(2)
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=generator)
    return model


@pytest.mark.parametrize("chunk_elements", [1, 2 * 40 * 48, 1 << 26])  # 1, 2 or all experts
def test_each_expert_row_is_quantized_as_a_dense_weight_whatever_the_chunk(chunk_elements):
    weight = torch.randn(5, 40, 48, generator=torch.Generator().manual_seed(0)).bfloat16()
    weight[3, 7] *= 100.0  # an outlier row keeps its scale to itself
    values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(5, 40)
    quantize_experts_into(weight, values, scale, chunk_elements)
    expected, expected_scale = quantize_weight(weight.flatten(0, 1), "engine")
    assert torch.equal(values.flatten(0, 1).view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scale.flatten(), expected_scale.flatten())
    assert scale[3, 7] > 50 * scale[3, 6]


def test_copies_cover_the_sparse_layers_and_refresh_in_place():
    model = _moe_model()
    layers = model.model.layers
    assert expert_tensors(layers[0]) is None  # tiny-moe's layer 0 is dense
    experts = Fp8Experts(model)
    assert experts.layers == {}  # made by refresh()
    experts.refresh()
    assert sorted(experts.layers) == [1, 2, 3] and experts.of(0) is None
    copy = experts.of(2)
    gate_up = layers[2].mlp.experts.gate_up_proj
    assert copy.gate_up.shape == gate_up.shape and copy.gate_up_scale.shape == gate_up.shape[:2]
    assert copy.down.shape == layers[2].mlp.experts.down_proj.shape
    storage = copy.down.data_ptr()
    layers[2].mlp.experts.down_proj.mul_(-1.0)  # a weight sync in place
    experts.refresh()
    assert experts.of(2).down.data_ptr() == storage  # captured graphs read the same memory
    flipped = experts.of(2).down.float() * experts.of(2).down_scale[..., None]
    torch.testing.assert_close(flipped, layers[2].mlp.experts.down_proj, rtol=2**-4, atol=1e-3)
    element_bytes = sum(t.numel() for t in copy[::2])  # e4m3: a byte an element
    assert experts.nbytes() == 3 * (element_bytes + 4 * sum(t.numel() for t in copy[1::2]))


def test_fp8_matmul_quantizes_dense_projections_and_the_experts_of_a_moe():
    """The sparse layers' experts are the expert copies', never looked up as projections;
    layer 0's dense MLP is a projection copy like a dense model's."""
    model = _moe_model()
    matmul = Fp8Matmul(model, fused=None)
    layers = model.model.layers
    # q, k, v, o per layer, and gate, up, down for the dense layer 0
    assert len(matmul.copies) == 4 * len(layers) + 3
    assert layers[0].mlp.gate_proj.weight.data_ptr() in matmul.copies
    assert sorted(matmul.experts.layers) == [1, 2, 3]
    assert matmul.nbytes() > matmul.experts.nbytes() > 0
