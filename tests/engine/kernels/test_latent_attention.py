"""MLA's absorbed decode attention kernel (kernels/latent_attention.py) against the torch
reference (mla_absorbed.absorbed_attention on the gathered latents), paged and slot caches;
and a DeepSeek-V3 engine decoding with it against the torch step. Runs on CUDA (marked gpu),
or on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.engine.kernels.latent_attention import latent_decode_attention  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.mixers.mla_absorbed import absorbed_attention  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

RANK, ROPE, BLOCK = 32, 8, 4
# Triton's interpreter computes tl.dot of bf16 operands wrongly (checked with a bare 16 x 16
# dot): the 16-bit case runs on CUDA only, as the other attention kernels' tests do.
BF16 = pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="bf16 tl.dot under TRITON_INTERPRET is wrong"))  # fmt: skip


def _reference(q, qr, latents, table, slots, lengths, scale):
    """The rows' positions gathered through the table, then the torch op."""
    length = int(lengths.max())
    if table is None:
        gathered = latents[slots, :length]
    else:
        blocks = table[slots, : -(-length // BLOCK)].long()
        gathered = latents[blocks].flatten(1, 2)[:, :length]
    visible = torch.arange(length, device=q.device)[None] < lengths[:, None]
    latent, k_rope = gathered.float().split([RANK, ROPE], dim=-1)
    return absorbed_attention(q.float(), qr.float(), latent, k_rope, visible, scale)


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), BF16])
def test_kernel_equals_the_torch_op_over_the_cache(paged, dtype, tolerance):
    """5 rows of 20 heads (two head tiles, the second partial), lengths 1 to 37 (several
    position tiles, a partial last one); a paged cache's blocks out of order."""
    torch.manual_seed(0)
    rows, heads = 5, 20
    slots = torch.tensor([2, 0, 3, 1, 2], device=DEVICE)
    lengths = torch.tensor([37, 1, 16, 9, 20], device=DEVICE)
    table = None
    if paged:
        per_slot = 10
        order = torch.randperm(4 * per_slot, device=DEVICE).to(torch.int32)
        table = order.view(4, per_slot)
        latents = torch.randn(4 * per_slot + 1, BLOCK, RANK + ROPE, device=DEVICE).to(dtype)
    else:
        latents = torch.randn(4, 40, RANK + ROPE, device=DEVICE).to(dtype)
    q = torch.randn(rows, heads, RANK, device=DEVICE).to(dtype)
    qr = torch.randn(rows, heads, ROPE, device=DEVICE).to(dtype)
    got = latent_decode_attention(q, qr, latents, slots, lengths, 0.3, RANK, table)
    expected = _reference(q, qr, latents, table, slots, lengths, 0.3)
    assert got.shape == (rows, heads, RANK) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_deepseek_engine_with_the_kernel_samples_the_torch_steps_tokens():
    """decode_backend='triton' on tiny-deepseek-v3: the model's modules, the absorbed
    attention in the kernel, past a block of 16; greedy tokens and log-probs (fp32) of the
    torch step, n = 2; then a kept turn, its new tokens extending the latents through the
    kernel too."""
    model = build_model(preset_config("tiny-deepseek-v3"), seed=1).to(DEVICE).eval()
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    prompts = [list(range(5, 19)), [10, 11]]  # the first decodes past position 16
    params = SamplingParams(n=2, temperature=0, max_new_tokens=4, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = Engine(model, max_batch_size=4, max_seq_len=32,
                        options=EngineOptions(decode_backend=backend, cuda_graphs=False,
                                              kv_block_size=16))  # fmt: skip
        assert engine.native and engine.recurrent_step == backend
        first = engine.generate(prompts, params)
        turn = prompts[0] + first[0].token_ids + [7, 8, 9]
        kept = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
        handle = engine.generate([prompts[0]], kept, keep=True)[0].kv_handle
        assert handle is not None
        before = engine.prefill_tokens
        second = engine.generate([turn], kept, reuse=[handle])
        assert engine.prefill_tokens - before < len(turn)  # extended, not prefilled
        results[backend] = first + second
    for fused, plain in zip(results["triton"], results["torch"]):
        assert fused.token_ids == plain.token_ids
        torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=1e-4, rtol=0)


def test_kernel_at_deepseek_v3_widths():
    """512 latent + 64 rope values a token (V3's), 16 heads, two rows over a paged cache."""
    torch.manual_seed(1)
    rank, rope = 512, 64
    latents = torch.randn(9, BLOCK, rank + rope, device=DEVICE) * 0.1
    table = torch.arange(8, device=DEVICE, dtype=torch.int32).flip(0).view(2, 4)
    slots, lengths = torch.tensor([1, 0], device=DEVICE), torch.tensor([13, 16], device=DEVICE)
    q = torch.randn(2, 16, rank, device=DEVICE) * 0.1
    qr = torch.randn(2, 16, rope, device=DEVICE)
    got = latent_decode_attention(q, qr, latents, slots, lengths, 0.07, rank, table)
    blocks = table[slots].long()
    gathered = latents[blocks].flatten(1, 2)
    visible = torch.arange(16, device=DEVICE)[None] < lengths[:, None]
    latent, k_rope = gathered.split([rank, rope], dim=-1)
    expected = absorbed_attention(q, qr, latent, k_rope, visible, 0.07)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
