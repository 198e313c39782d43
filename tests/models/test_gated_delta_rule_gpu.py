"""fla-core's chunk kernel against the chunked torch reference on CUDA: packed sequences of
uneven lengths (states reset at each boundary), grouped key heads, outputs, final states and
gradients; then a whole tiny Qwen3.5 whose DeltaNet layers run either backend."""

import pytest
import torch

from hybridflow.models.mixers import gated_delta_rule as gdr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(gdr._fla_chunk() is None, reason="needs fla-core (pip install fla-core)"),
]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _packed_inputs(lengths, key_heads=2, value_heads=4, dk=64, dv=64):
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda")

    q, k = randn(total, key_heads, dk), randn(total, key_heads, dk)
    v = randn(total, value_heads, dv)
    # a decay of the size Qwen3.5's gates give: exp(g) in about (0.6, 1)
    g = -0.5 * torch.rand(total, value_heads, generator=generator, device="cuda")
    beta = torch.rand(total, value_heads, generator=generator, device="cuda")
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    return [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16()], cu_seqlens.int()


def test_fla_kernel_matches_the_torch_reference_on_packed_sequences():
    lengths = [1, 130, 64, 257, 7]
    inputs, cu_seqlens = _packed_inputs(lengths)
    with torch.no_grad():
        fla_out, fla_state = gdr.packed_gated_delta_rule(
            *inputs, cu_seqlens, max(lengths), backend="fla", final_state=True
        )
        ref_out, ref_state = gdr.packed_gated_delta_rule(  # fp32 inside, same bf16 inputs
            *inputs, cu_seqlens, max(lengths), backend="torch", final_state=True
        )
    assert fla_out.shape == ref_out.shape and fla_state.shape == ref_state.shape
    assert _rel(fla_out, ref_out) < 2e-2
    assert _rel(fla_state, ref_state) < 2e-2
    # the first sequence is one token: its output is beta * v * (q.k) with normalised q, k
    # scaled by Dk^-0.5, computed apart from its neighbours
    q, k, v, _, beta = (x[0].float() for x in inputs)
    qn, kn = gdr.l2_normalize(q), gdr.l2_normalize(k)
    qk = (qn * kn).sum(-1).repeat_interleave(2) * 64**-0.5  # [Hv]
    alone = beta[:, None] * v * qk[:, None]
    assert _rel(fla_out[0], alone) < 2e-2


def test_fla_gradients_match_the_torch_reference_where_its_backward_is_sound():
    device = torch.device("cuda")
    lengths = [1, 130, 64, 257, 7]
    inputs, cu_seqlens = _packed_inputs(lengths)
    grad_out = torch.randn(sum(lengths), 4, 64, device="cuda")

    def grads(backend):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = gdr.packed_gated_delta_rule(*leaves, cu_seqlens, max(lengths), backend=backend)
        (out.float() * grad_out).sum().backward()
        return [x.grad for x in leaves]

    if problem := gdr.fla_backward_problem(device):
        # refused before the forward runs, and "auto" trains on the reference instead
        with pytest.raises(RuntimeError, match="backend='torch'"):
            grads("fla")
        with pytest.warns(UserWarning, match="chunked torch reference trains here"):
            assert gdr.resolve_delta_backend("auto", device, torch.bfloat16, True) == "torch"
        pytest.skip(problem)
    for name, got, want in zip("q k v g beta".split(), grads("fla"), grads("torch")):
        assert _cosine(got, want) > 0.999, name


def test_qwen3_5_logprobs_agree_across_delta_backends():
    from hybridflow.models import load_model

    model = load_model("tiny-hybrid").cuda().bfloat16().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 96), device="cuda")

    def logits_with(backend):
        for module in model.modules():
            if hasattr(module, "delta_backend"):
                module.delta_backend = backend
        with torch.no_grad():
            return model(ids).float()

    fla, reference = logits_with("fla"), logits_with("torch")
    assert _rel(fla, reference) < 2e-2
    assert (fla.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95
