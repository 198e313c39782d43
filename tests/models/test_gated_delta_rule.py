"""The gated delta rule: the chunked form equals the token-by-token loop (forward, final state
and gradients, fp64), packed sequences keep their states apart, and the fla-core backend is
chosen only where it can run."""

import pytest
import torch

from hybridflow.models.mixers import gated_delta_rule as gdr
from hybridflow.models.mixers.gated_deltanet import (
    TokenLayout,
    causal_conv_packed,
    causal_conv_rows,
)


def _inputs(batch=2, length=37, key_heads=2, value_heads=4, dk=8, dv=6, dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    q, k = randn(batch, length, key_heads, dk), randn(batch, length, key_heads, dk)
    v = randn(batch, length, value_heads, dv)
    g = -torch.rand(batch, length, value_heads, generator=generator, dtype=dtype)
    beta = torch.rand(batch, length, value_heads, generator=generator, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
def test_chunked_equals_the_recurrent_loop(chunk_size):
    inputs = _inputs()
    state = torch.randn(2, 4, 8, 6, dtype=torch.float64)
    out, final = gdr.recurrent_gated_delta_rule(*inputs, initial_state=state)
    chunked, chunked_final = gdr.chunked_gated_delta_rule(
        *inputs, initial_state=state, chunk_size=chunk_size
    )
    assert torch.allclose(chunked, out, atol=1e-10)
    assert torch.allclose(chunked_final, final, atol=1e-10)


def test_chunked_backward_matches_autograd_of_the_loop():
    leaves = [x.requires_grad_() for x in _inputs(length=21)]
    weights = torch.randn(2, 21, 4, 6, dtype=torch.float64)
    (gdr.recurrent_gated_delta_rule(*leaves)[0] * weights).sum().backward()
    expected = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    (gdr.chunked_gated_delta_rule(*leaves, chunk_size=8)[0] * weights).sum().backward()
    for name, x, grad in zip("q k v g beta".split(), leaves, expected):
        assert torch.allclose(x.grad, grad, atol=1e-9), name


def test_matches_transformers_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    inputs = _inputs()
    expected, _ = torch_chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)
    assert torch.allclose(gdr.chunked_gated_delta_rule(*inputs)[0], expected, atol=1e-6)


def _packed(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (
        torch.randn(total, 2, 8, generator=generator),
        torch.randn(total, 2, 8, generator=generator),
    )
    v = torch.randn(total, 4, 6, generator=generator)
    g = -torch.rand(total, 4, generator=generator)
    beta = torch.rand(total, 4, generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [q, k, v, g, beta], cu_seqlens


def test_packed_sequences_start_from_a_zero_state():
    lengths = [5, 70, 1, 9]
    inputs, cu_seqlens = _packed(lengths)
    out = gdr.packed_gated_delta_rule(*inputs, cu_seqlens, max(lengths), backend="torch")
    for i, length in enumerate(lengths):
        start = int(cu_seqlens[i])
        alone = [x[start : start + length][None] for x in inputs]
        expected = gdr.recurrent_gated_delta_rule(*alone)[0][0]
        assert torch.allclose(out[start : start + length], expected, atol=1e-5), i


def test_short_packed_sequences_are_not_padded_to_a_whole_chunk(monkeypatch):
    """Rows of a few tokens (an engine pass feeding a token or a draft a row) run in chunks of
    the longest row, with the zero-state reference's results."""
    chunks = []
    chunked = gdr.chunked_gated_delta_rule

    def spy(*args, chunk_size=64, **kwargs):
        chunks.append(chunk_size)
        return chunked(*args, chunk_size=chunk_size, **kwargs)

    monkeypatch.setattr(gdr, "chunked_gated_delta_rule", spy)
    lengths = [1, 3, 2]
    inputs, cu_seqlens = _packed(lengths)
    out = gdr.packed_gated_delta_rule(*inputs, cu_seqlens, max(lengths), backend="torch")
    assert chunks == [3]
    for i, length in enumerate(lengths):
        start = int(cu_seqlens[i])
        alone = [x[start : start + length][None] for x in inputs]
        expected = gdr.recurrent_gated_delta_rule(*alone)[0][0]
        assert torch.allclose(out[start : start + length], expected, atol=1e-5), i


def test_a_neighbour_in_the_pack_changes_nothing():
    lengths = [6, 11]
    inputs, cu_seqlens = _packed(lengths)
    changed = [x.clone() for x in inputs]
    for x in changed:
        x[:6] = x[:6] * 3 - 1 if x.dtype.is_floating_point else x[:6]
    changed[3] = -changed[3].abs()  # g stays a decay
    changed[4] = changed[4].clamp(0, 1)
    before = gdr.packed_gated_delta_rule(*inputs, cu_seqlens, 11, backend="torch")
    after = gdr.packed_gated_delta_rule(*changed, cu_seqlens, 11, backend="torch")
    assert torch.equal(before[6:], after[6:])
    assert not torch.allclose(before[:6], after[:6])


def test_packed_conv_stays_inside_each_sequence():
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1]
    x = torch.randn(sum(lengths), 5, generator=generator)
    weight = torch.randn(5, 1, 4, generator=generator)
    cu_seqlens = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    layout = TokenLayout.packed(cu_seqlens, 7)
    packed = causal_conv_packed(x, weight, layout.columns)
    rows = [causal_conv_rows(part[None], weight)[0] for part in x.split(lengths)]
    assert torch.allclose(packed, torch.cat(rows), atol=1e-6)


def test_backend_choice():
    assert gdr.resolve_delta_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="not one of"):
        gdr.resolve_delta_backend("triton", torch.device("cpu"))
    if gdr._fla_chunk() is None:
        with pytest.raises(ImportError, match="pip install fla-core"):
            gdr.resolve_delta_backend("fla", torch.device("cpu"))


def test_fla_call_site_hands_one_varlen_row(monkeypatch):
    """The fla call: one batch row, int64 cu_seqlens, key heads expanded to the value heads,
    q/k normalised in the kernel; what it returns comes back without the batch axis."""
    seen = {}

    def fake_chunk(q, k, v, g, beta, **kwargs):
        seen.update(q=q.shape, k=k.shape, v=v.shape, g=g.shape, **kwargs)
        return v * 2, None

    monkeypatch.setattr(gdr, "_fla_chunk", lambda: fake_chunk)
    inputs, cu_seqlens = _packed([4, 3])
    with pytest.raises(ValueError, match="bf16/fp16 inputs"):  # fla refuses fp32 q/k/v
        gdr.packed_gated_delta_rule(*inputs, cu_seqlens, 4, backend="fla")
    assert gdr.resolve_delta_backend("auto", torch.device("cuda"), torch.float32) == "torch"
    inputs = [x.bfloat16() for x in inputs]
    out = gdr.packed_gated_delta_rule(*inputs, cu_seqlens, 4, backend="fla")
    assert seen["q"] == seen["k"] == (1, 7, 4, 8) and seen["v"] == (1, 7, 4, 6)
    assert seen["cu_seqlens"].dtype == torch.int64 and seen["use_qk_l2norm_in_kernel"]
    assert torch.equal(out, inputs[2] * 2)
    assert seen["output_final_state"] is False


@pytest.mark.parametrize(
    "capability, triton_version, has_tilelang, sound",
    [
        ((9, 0), "3.6.0", False, False),  # Hopper, a Triton whose compiler breaks fla's backward
        ((9, 0), "3.7.1", False, True),
        ((9, 0), "3.3.1", False, True),
        ((9, 0), "3.6.0", True, True),  # tilelang's kernel replaces the broken one
        ((8, 0), "3.6.0", False, True),
    ],
)
def test_fla_backward_is_used_only_where_it_is_sound(
    monkeypatch, capability, triton_version, has_tilelang, sound
):
    import importlib.util

    import triton

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(triton, "__version__", triton_version)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if has_tilelang else None) if name == "tilelang" else find_spec(name, *a)
        ),
    )
    monkeypatch.setattr(gdr, "_fla_chunk", lambda: object())
    cuda = torch.device("cuda")
    assert (gdr.fla_backward_problem(cuda) is None) == sound
    assert gdr.resolve_delta_backend("auto", cuda, torch.bfloat16, needs_grad=False) == "fla"
    if sound:
        assert gdr.resolve_delta_backend("auto", cuda, torch.bfloat16, needs_grad=True) == "fla"
        return
    with pytest.warns(UserWarning, match="Triton >= 3.7.1"):
        assert gdr.resolve_delta_backend("auto", cuda, torch.bfloat16, needs_grad=True) == "torch"
    with pytest.raises(RuntimeError, match="backend='torch'"):
        gdr.resolve_delta_backend("fla", cuda, torch.bfloat16, needs_grad=True)
