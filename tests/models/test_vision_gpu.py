"""The vision encoder's attention on CUDA: FlashAttention's varlen kernel without the causal
mask (one launch for every window) equals SDPA window by window, outputs and gradients; a
whole encoder in bf16 stays within bf16's error of fp32."""

import pytest
import torch

from hybridflow.models import load_model
from hybridflow.models.vision.qwen2_5_vl import Segments, segment_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]  # fmt: skip


def test_flash_segments_equal_sdpa_segment_by_segment():
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = [64, 17, 64, 100, 3]
    q, k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16,
                           generator=generator).requires_grad_() for _ in range(3))  # fmt: skip
    flash = segment_attention(q, k, v, Segments.of(lengths, q.device))
    (dq, dk, dv) = torch.autograd.grad(flash.float().square().sum(), (q, k, v))
    loop = segment_attention(q, k, v, Segments(lengths))
    (rq, rk, rv) = torch.autograd.grad(loop.float().square().sum(), (q, k, v))
    assert (flash.float() - loop.float()).abs().max() < 2e-2
    for ours, ref in ((dq, rq), (dk, rk), (dv, rv)):
        assert ((ours.float() - ref.float()).norm() / ref.float().norm()) < 2e-2


def test_encoder_in_bf16_on_cuda_is_close_to_fp32():
    model = load_model("tiny-vl", device="cuda").eval()
    grid = torch.tensor([[1, 8, 12], [1, 4, 4]], device="cuda")
    pixels = torch.randn(int(grid.prod(-1).sum()), model.config.vision.patch_elements,
                         device="cuda")  # fmt: skip
    with torch.no_grad():
        reference = model.visual(pixels, grid)
        bf16 = model.visual.to(torch.bfloat16)(pixels, grid).float()
    assert ((bf16 - reference).norm() / reference.norm()) < 3e-2
