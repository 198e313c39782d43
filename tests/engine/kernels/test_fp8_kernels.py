"""The e4m3 kernels against fp8/e4m3.quantize_rows_reference, bit for bit: the standalone quantizer
(kernels/fp8_quant.py), the norms and SiLU*up that write e4m3 rows (rowwise.py's *_e4m3), and
the split layer fed by them against the same layer quantizing in front of each matmul.
CUDA (marked gpu) or CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine.fp8 import matmul as fp8  # noqa: E402
from hybridflow.engine.fp8.e4m3 import E4M3, quantize_rows_reference  # noqa: E402
from hybridflow.engine.fp8.matmul import Fp8Matmul  # noqa: E402
from hybridflow.engine.kernels import rowwise  # noqa: E402
from hybridflow.engine.kernels.fp8_quant import quantize_rows_triton  # noqa: E402
from hybridflow.engine.kernels.launch import PLAIN  # noqa: E402
from hybridflow.engine.layers.split import fused_layers  # noqa: E402
from hybridflow.engine.weights.fused import FusedProjections  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402


def _assert_same_rows(got, want):
    """Same scales, and the same e4m3 bytes (so -0 against +0 counts as a difference)."""
    assert got.values.dtype == E4M3 and got.scale.shape == want.scale.shape
    torch.testing.assert_close(got.scale, want.scale, rtol=0, atol=0)
    assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))


def test_quantizer_rounds_every_e4m3_tie_and_subnormal_as_torch_does():
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = codes[~codes.isnan()].unique()  # every e4m3 value, ±448 and the subnormals
    ties = (grid[1:] + grid[:-1]) / 2  # round to even; one fp32 step either side does not
    above, below = ties.nextafter(torch.tensor(1e9)), ties.nextafter(torch.tensor(-1e9))
    values = torch.cat([grid, ties, above, below, torch.tensor([-0.0, 1e-30, -1e-30])])
    # a row whose max is 448 has scale 1: x / scale is x, so each value lands as written
    row = torch.cat([torch.tensor([448.0]), values])
    x = torch.stack([row, row * 3.7, torch.randn(row.shape[0]) * 20, torch.zeros_like(row)])
    x = x.to(DEVICE)
    _assert_same_rows(quantize_rows_triton(x), quantize_rows_reference(x))


class _Norm:
    def __init__(self, dim, generator):
        self.weight = torch.randn(dim, generator=generator).to(DEVICE, torch.bfloat16)
        self.eps = 1e-6


@pytest.mark.parametrize("add, weighted", [(False, True), (True, True), (True, False)])
def test_norms_write_the_quantized_rows_of_their_output(add, weighted):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 96, generator=generator) * 3).to(DEVICE, torch.bfloat16)
    delta = torch.randn(5, 96, generator=generator).to(DEVICE, torch.bfloat16)
    norm = _Norm(96, generator)
    x[3] = 0  # an all-zero row (without the add): zeros and a finite scale
    if add:
        residual = x.clone()
        got = rowwise.add_rms_norm_e4m3(residual, delta, norm, weighted)
        plain_residual = x.clone()
        want = rowwise.add_rms_norm(plain_residual, delta, norm, weighted)
        assert torch.equal(residual, plain_residual)  # the stream updated the same way
    else:
        got = rowwise.rms_norm_e4m3(x, norm, weighted)
        want = rowwise.rms_norm(x, norm, weighted)
    _assert_same_rows(got, quantize_rows_reference(want))


@pytest.mark.parametrize("pairs", [True, False])
def test_silu_mul_writes_the_quantized_rows_of_its_output(pairs):
    inner = rowwise.SILU_E4M3_BLOCK + 52  # two passes a row, the second one masked
    generator = torch.Generator().manual_seed(1)
    product = (torch.randn(3, 2 * inner, generator=generator) * 4).to(DEVICE, torch.bfloat16)
    product[1] = 0
    if pairs:
        got = rowwise.silu_mul_pairs_e4m3(product)
        want = rowwise.silu_mul_pairs(product)
    else:
        gate, up = product[:, :inner], product[:, inner:]
        got, want = rowwise.silu_mul_e4m3(gate, up), rowwise.silu_mul(gate, up)
    _assert_same_rows(got, quantize_rows_reference(want))


class _QuantizeInFront:
    """The fp8 matmuls fed model-dtype activations, each quantizing its own input: the split
    layer without the e4m3 norms and SiLU*up (not an Fp8Matmul, so it gets the plain ones)."""

    def __init__(self, matmul: Fp8Matmul):
        self.matmul = matmul

    def linear(self, x, weight, bias=None):
        return self.matmul.linear(x, weight, bias)

    def gate_up_silu(self, x, weight_pairs, launch=PLAIN):
        return rowwise.silu_mul_pairs(self.matmul.linear(x, weight_pairs), launch=launch)


def _attend(index, q, k, v):  # a stand-in for attention: mixes q and v, [N, nh, D]
    return q * 0.5 + v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)


@pytest.mark.parametrize("fuse", ["none", "qkv", "all"])
def test_split_layer_with_e4m3_activations_is_bitwise_the_quantize_in_front_layer(
    fuse, monkeypatch
):
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    model = model.to(torch.bfloat16).requires_grad_(False)
    fused = None if fuse == "none" else FusedProjections(model, gate_up=fuse == "all")
    matmul = Fp8Matmul(model, fused)
    tokens = torch.tensor([5, 17, 9, 33, 2, 71, 40], device=DEVICE)
    want = fused_layers(model, tokens, _attend, fused, _QuantizeInFront(matmul))

    quantized = []  # the quantize launches left: the attention output's, one a layer
    quantize = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda x: quantized.append(x) or quantize(x))
    got = fused_layers(model, tokens, _attend, fused, matmul)
    assert len(quantized) == len(model.model.layers)
    assert torch.equal(got, want)
