"""CUDA paths: the fused packed attention kernels and bf16 numerics (needs a CUDA device)."""

import pytest
import torch
from model_helpers import randomized_model, small_config

from hybridflow.models.attention import make_packed_attention
from hybridflow.models.heads.logprobs import logprobs_from_hidden, naive_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("backend", ["flash_varlen"])  # flex: see the benchmark
def test_packed_attention_kernels_match_reference(backend):
    lengths = [1, 130, 64, 257, 7]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_seqlens = cu_seqlens.cuda()
    n = sum(lengths)
    q0 = torch.randn(n, 8, 64, device="cuda", dtype=torch.bfloat16)
    k0 = torch.randn(n, 2, 64, device="cuda", dtype=torch.bfloat16)
    v0 = torch.randn(n, 2, 64, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(q0)

    def run(name):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = make_packed_attention(name, cu_seqlens, max(lengths), n)(q, k, v)
        out.backward(grad)
        return out, q.grad, k.grad, v.grad

    for got, want in zip(run(backend), run("sdpa_loop")):
        assert _rel(got, want) < 2e-2


def test_bf16_packed_forward_matches_padded_on_cuda():
    model = randomized_model(small_config("qwen3", head_dim=64)).to("cuda", torch.bfloat16)
    lengths = [5, 33, 12]
    seqs = [torch.randint(3, 97, (n,), device="cuda") for n in lengths]
    cu = torch.tensor([0, 5, 38, 50], dtype=torch.int32, device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    with torch.no_grad():
        packed = model.lm_head(model.forward_packed(torch.cat(seqs), pos, cu, 33))
        one_by_one = torch.cat([model(s[None])[0] for s in seqs])
    assert _rel(packed, one_by_one) < 2e-2


def test_bf16_chunked_logprobs_close_to_fp32_naive():
    hidden = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(5000, 256, device="cuda", dtype=torch.bfloat16) * 0.05
    targets = torch.randint(0, 5000, (3000,), device="cuda")
    logprobs, entropy = logprobs_from_hidden(
        hidden, weight, targets, with_entropy=True, chunk_size=1024
    )
    ref_lp, ref_ent = naive_logprobs(hidden.detach().float(), weight.float(), targets)
    assert (logprobs - ref_lp).abs().max() < 0.1
    assert (entropy - ref_ent).abs().max() < 0.1
    logprobs.sum().backward()
    assert torch.isfinite(hidden.grad).all()
