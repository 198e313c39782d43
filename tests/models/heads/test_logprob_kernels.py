"""The Triton log-prob/entropy kernels (half-precision logits) against the torch chunked path
on the same bf16 inputs: values and gradients. CUDA (marked gpu), or CPU under
TRITON_INTERPRET=1 when triton is installed (make test runs them so); skipped otherwise."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.models.heads.logprobs import _ChunkedLogprobs, _use_kernels  # noqa: E402


def _run(kernels: bool, temperature: float, chunk: int, entropy_grad: bool, logprob_grad: bool):
    g = torch.Generator().manual_seed(0)
    n, h, v = 45, 32, 2500  # v spans two kernel blocks (2048) with a ragged tail
    hidden = (torch.randn(n, h, generator=g) * 2).to(DEVICE, torch.bfloat16).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    targets[0], targets[1] = 0, v - 1  # first and last vocabulary entries
    g_lp = torch.randn(n, generator=g).to(DEVICE)
    g_ent = torch.randn(n, generator=g).to(DEVICE)
    logprobs, entropy = _ChunkedLogprobs.apply(
        hidden, weight, targets, temperature, True, chunk, kernels
    )
    loss = 0
    if logprob_grad:
        loss = loss + (logprobs * g_lp).sum()
    if entropy_grad:
        loss = loss + (entropy * g_ent).sum()
    loss.backward()
    return logprobs, entropy, hidden.grad.float(), weight.grad.float()


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_kernels_are_used_for_half_precision_only():
    assert _use_kernels(torch.zeros(2, 2, dtype=torch.bfloat16, device=DEVICE))
    assert not _use_kernels(torch.zeros(2, 2, dtype=torch.float32, device=DEVICE))


@pytest.mark.parametrize(
    "temperature,chunk,entropy_grad,logprob_grad",
    [(1.0, 4096, True, True), (0.7, 16, True, True), (1.0, 7, False, True), (1.3, 16, True, False)],
)
def test_kernel_path_equals_torch_path(temperature, chunk, entropy_grad, logprob_grad):
    """Same bf16 logits on both paths, so the fp32 statistics agree to float rounding; the
    gradients go through one bf16 rounding of d/dlogits on both paths."""
    ours = _run(True, temperature, chunk, entropy_grad, logprob_grad)
    ref = _run(False, temperature, chunk, entropy_grad, logprob_grad)
    torch.testing.assert_close(ours[0], ref[0], atol=2e-5, rtol=2e-5)  # log-probs
    torch.testing.assert_close(ours[1], ref[1], atol=2e-5, rtol=2e-5)  # entropy
    assert _relative(ours[2], ref[2]) < 1e-2  # d hidden
    assert _relative(ours[3], ref[3]) < 1e-2  # d weight
    assert ours[2].abs().sum() > 0 and ours[3].abs().sum() > 0
