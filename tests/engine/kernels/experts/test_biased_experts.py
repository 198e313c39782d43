"""GPT-OSS's experts on the engine's grouped path (layers/biased_moe.biased_experts_grouped:
torch._grouped_mm, the bias and clamped SwiGLU kernel and the combine with the down bias,
kernels/experts/biased_experts.py) against the model's own (BiasedExpertsMoeBlock.experts_output):
in fp32, with gates and ups past the clamp and experts no token picks; on
CUDA in bf16 (gpu-marked)."""

from __future__ import annotations

import copy

import pytest
import torch
from triton_device import triton_test_device

from hybridflow.engine.layers.biased_moe import biased_experts_grouped, grouped_runs
from hybridflow.models.mlps.biased_experts import BiasedExpertsMoeBlock, topk_softmax_route
from hybridflow.models.presets import preset_config

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
# torch._grouped_mm's CUDA kernel takes bf16 only: the fp32 cases run on the CPU, under
# TRITON_INTERPRET=1
fp32_on_cpu = pytest.mark.skipif(DEVICE == "cuda", reason="fp32 grouped path: CPU only")


def _block(dtype=torch.float32, experts: int = 6, seed: int = 3):
    config = preset_config("tiny-gpt-oss").replace(num_experts=experts)
    block = BiasedExpertsMoeBlock(config)
    generator = torch.Generator().manual_seed(seed)
    for p in block.parameters():  # large enough that gates and ups pass the clamp at 7
        p.data = torch.randn(p.shape, generator=generator) * 2.0
    return block.to(DEVICE, dtype).requires_grad_(False)


def _routed(block, tokens: int, seed: int = 4):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, block.router.weight.shape[1], generator=generator)
    x = x.to(DEVICE, block.router.weight.dtype)
    ids, weights = topk_softmax_route(block.router_logits(x), block.top_k)
    return x, ids, weights


@fp32_on_cpu
@pytest.mark.parametrize("tokens", [1, 37])
def test_grouped_experts_equal_the_models_in_fp32(tokens):
    block = _block()
    x, ids, weights = _routed(block, tokens)
    past_clamp = (x @ block.experts.gate_up_proj[0]).abs() > block.swiglu_limit
    assert grouped_runs(block, x) and past_clamp.float().mean() > 0.1
    got = biased_experts_grouped(block, x, ids, weights)
    expected = block.experts_output(x, ids, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@fp32_on_cpu
def test_experts_no_token_picks_run_no_rows():
    """8 experts, 3 tokens of top-2: most experts run no rows (empty groups)."""
    block = _block(experts=8)
    x, ids, weights = _routed(block, 3)
    got = biased_experts_grouped(block, x, ids, weights)
    torch.testing.assert_close(got, block.experts_output(x, ids, weights), rtol=1e-5, atol=1e-4)


def test_lora_or_another_dtype_keeps_the_models_path():
    from hybridflow.models.moe import ExpertLoRA

    block = _block()
    x, _, _ = _routed(block, 4)
    assert not grouped_runs(block, x.double())  # the weights are fp32
    generator = torch.Generator(device=block.experts.gate_up_proj.device).manual_seed(0)
    block.experts.lora = ExpertLoRA(block.experts, 2, 4.0, generator)  # as learners/lora.py does
    assert not grouped_runs(block, x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_experts_in_bf16_on_cuda_are_the_models():
    """bf16 on CUDA: each rounding where the model's torch ops round (grouped GEMMs on both
    sides), so the outputs agree to a bf16 step (of the largest: sums of signed terms near 0
    have no relative bound)."""
    block = _block(torch.bfloat16, experts=32)
    x, ids, weights = _routed(block, 4096)
    got = biased_experts_grouped(block, x, ids, weights)
    expected = block.experts_output(x, ids, weights)
    gap = (got.float() - expected.float()).abs().max()
    assert gap <= 1e-2 * expected.float().abs().max()  # a bf16 step of the largest output


@pytest.mark.parametrize("tokens", [1, 37])
def test_triton_experts_equal_the_models_in_fp32(tokens):
    """The grouped Triton kernels over the experts as stored ([E, in, out]), the bias and
    the clamped SwiGLU in the gate/up kernel, against the model's (fp32, CPU or CUDA)."""
    from hybridflow.engine.layers.biased_moe import biased_experts_triton, triton_runs

    block = _block(experts=8)
    x, ids, weights = _routed(block, tokens)
    assert triton_runs(block, x)
    got = biased_experts_triton(block, x, ids, weights)
    # the model's grouped GEMMs take bf16 on CUDA: its fp32 loop on the CPU
    reference = copy.deepcopy(block).cpu()
    expected = reference.experts_output(x.cpu(), ids.cpu(), weights.cpu())
    # outputs up to ~1.5e3 (weights of std 2): a few fp32 ulps of the largest, as the
    # summation orders differ
    atol = 1e-6 * expected.abs().max().item()
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_experts_in_bf16_on_cuda_are_the_grouped_paths():
    """bf16 at gpt-oss-20b's expert widths (8 of its 32 experts), 256 decode rows: the
    Triton kernels against the torch._grouped_mm path, within a bf16 step of the largest
    output."""
    from hybridflow.engine.layers.biased_moe import biased_experts_triton

    config = preset_config("gpt-oss-20b").replace(num_experts=8)
    block = BiasedExpertsMoeBlock(config)
    generator = torch.Generator().manual_seed(0)
    for p in block.parameters():
        p.data = torch.randn(p.shape, generator=generator) * 0.02
    block = block.to("cuda", torch.bfloat16).requires_grad_(False)
    x, ids, weights = _routed(block, 256)
    got = biased_experts_triton(block, x, ids, weights).float()
    want = biased_experts_grouped(block, x, ids, weights).float()
    assert (got - want).abs().max() <= 2**-7 * want.abs().max()
