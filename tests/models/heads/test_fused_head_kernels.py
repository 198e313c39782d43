"""The fused log-prob head's Triton kernels against its torch path on the same half-precision
inputs: values and gradients, with tokens and vocabulary split raggedly over programs and
backward blocks. CUDA (marked gpu; bf16 and fp16), or the CPU under TRITON_INTERPRET=1 (fp16:
the interpreter's bf16 tl.dot returns garbage); skipped otherwise."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.models.heads.fused_head import fused_logprobs  # noqa: E402
from hybridflow.models.heads.logprobs import _use_kernels, naive_logprobs  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


def _run(kernels, dtype, temperature, entropy_grad, h):
    """h: 24 (below one K block: masked loads) or 64 (one whole block: unmasked)."""
    g = torch.Generator().manual_seed(0)
    n, v = 40, 300  # vocabulary over 3 tiles, ragged
    hidden = (torch.randn(n, h, generator=g) * 2).to(DEVICE, dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    targets[0], targets[1], targets[2] = 0, v - 1, 128  # first, last, a tile's first entries
    upstream = torch.randn(2, n, generator=g).to(DEVICE)
    logprobs, entropy = fused_logprobs(
        hidden, weight, targets, temperature=temperature, with_entropy=True, kernels=kernels,
        token_chunk=16, vocab_chunk=128,
    )  # fmt: skip
    loss = (logprobs * upstream[0]).sum()
    if entropy_grad:
        loss = loss + (entropy * upstream[1]).sum()
    loss.backward()
    return logprobs, entropy, hidden.grad.float(), weight.grad.float(), (hidden, weight, targets)


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_kernels_are_used_for_half_precision_only():
    assert _use_kernels(torch.zeros(2, 2, dtype=torch.float16, device=DEVICE))
    assert not _use_kernels(torch.zeros(2, 2, dtype=torch.float32, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature,entropy_grad,hidden", [(1.0, True, 24), (0.7, False, 64)])
def test_kernel_path_equals_torch_path(dtype, temperature, entropy_grad, hidden):
    """The kernels' logits are fp32 sums of the half-precision products, the torch path's are
    rounded to half precision first, so the statistics agree to that rounding; both round
    d/dlogits to half precision once."""
    ours = _run(True, dtype, temperature, entropy_grad, hidden)
    ref = _run(False, dtype, temperature, entropy_grad, hidden)
    hidden, weight, targets = ours[4]
    exact = naive_logprobs(hidden.detach().double(), weight.detach().double(), targets,
                           temperature)  # fmt: skip
    torch.testing.assert_close(ours[0].double(), exact[0], atol=1e-4, rtol=1e-5)  # log-probs
    torch.testing.assert_close(ours[1].double(), exact[1], atol=1e-4, rtol=1e-5)  # entropy
    torch.testing.assert_close(ours[0], ref[0], atol=0.1, rtol=0.01)
    assert _relative(ours[2], ref[2]) < 2e-2  # d hidden
    assert _relative(ours[3], ref[3]) < 2e-2  # d weight
    assert ours[2].abs().sum() > 0 and ours[3].abs().sum() > 0
