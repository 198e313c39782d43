"""The sparse layers' experts on the eager decode step's Triton step (expert_step="triton",
layers/moe.mlp_torch), MLA's ropes, latent norm and store and the sink layers' ropes and
K/V stores in one kernel each there too: DeepSeek-V3's routed experts through kernels/experts/moe.py's grouped kernels
(routed_experts_triton) and GPT-OSS's biased experts through theirs
(layers/biased_moe.biased_experts_triton), never the model's moe_experts. In fp32 the whole
step (with the latent, sink-attention and norm kernels, as the engine runs it) against the
torch step: logits, routing record, greedy tokens; the engine's triton backend generates the
torch backend's tokens; a tensor-parallel rank's share of the fp8 experts on the W_FP8
kernels sums with the other's to the whole layer. Runs on CUDA in bf16 (marked gpu), or on
CPU under TRITON_INTERPRET=1 in fp32."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.engine.layers import eager  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.mixers.mla import MultiHeadLatentAttention  # noqa: E402
from hybridflow.models.mixers.sink_attention import SinkAttention  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402
from tests.engine.gpt_oss_helpers import gpt_oss_model  # noqa: E402

ROWS = 3
# bf16 on CUDA: the two steps round the experts' sums differently (the grouped kernels'
# fp32 combine against the model's); fp32: summation order only
TOLERANCE = dict(rtol=1e-4, atol=1e-4) if DEVICE == "cpu" else dict(rtol=5e-2, atol=5e-2)


def _deepseek():
    """tiny-deepseek-v3 (8 experts in 4 groups, 2 groups a token, a shared expert) with
    std-0.3 weights: peaked logits, greedy far from ties."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny-deepseek-v3"), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


MODELS = {"tiny-deepseek-v3": _deepseek, "tiny-gpt-oss": gpt_oss_model}


def _on_device(name: str):
    model = MODELS[name]().to(DEVICE)
    return model.to(torch.bfloat16) if DEVICE == "cuda" else model


def _step_outputs(model, step: str, monkeypatch=None):
    """(logits, routing record) of one decode step of ROWS rows at different positions over
    a cache of random latents / K/V, every eager step on `step`."""
    options = EngineOptions(decode_backend="torch", cuda_graphs=False)
    engine = Engine(model, ROWS, 32, options=options)
    assert engine.num_slots >= ROWS  # allocates the cache
    cache = engine.cache
    generator = torch.Generator(DEVICE).manual_seed(0)
    for buffer in (cache.latent, cache.keys, cache.values, getattr(cache.window, "keys", None),
                   getattr(cache.window, "values", None)):  # fmt: skip
        if buffer is not None and buffer.numel():
            noise = torch.randn(buffer.shape, generator=generator, device=DEVICE) * 0.5
            buffer.copy_(noise.to(buffer.dtype))
    tokens = torch.tensor([5, 9, 3], device=DEVICE)
    positions = torch.tensor([4, 17, 0], device=DEVICE)
    slots = torch.tensor([2, 0, 1], device=DEVICE)
    logits = eager.decode_forward_torch(
        model, cache, engine.rope, tokens, positions, slots, cache.max_seq_len,
        recurrent_step=step, attention_step=step, latent_step=step, norm_step=step,
        expert_step=step)  # fmt: skip
    return logits.float(), cache.routes.clone()


def _forbid_model_experts(monkeypatch, decode: bool = False):
    """The model's moe_experts raises; decode: so do MLA's project_latent and the sink
    attention's project_qkv (the triton steps turn, norm and store in one kernel:
    kernels/latent_rope.py, rowwise.rope_store)."""

    def model_path(*args, **kwargs):
        raise AssertionError("the triton step ran the model's own path")

    monkeypatch.setattr("hybridflow.models.moe.moe_experts", model_path)
    monkeypatch.setattr("hybridflow.models.mlps.biased_experts.moe_experts", model_path)
    if decode:
        monkeypatch.setattr(MultiHeadLatentAttention, "project_latent", model_path)
        monkeypatch.setattr(SinkAttention, "project_qkv", model_path)


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_step_runs_the_experts_on_the_grouped_kernels(name, monkeypatch):
    model = _on_device(name)
    want_logits, want_routes = _step_outputs(model, "torch")
    _forbid_model_experts(monkeypatch, decode=True)
    logits, routes = _step_outputs(model, "triton")
    torch.testing.assert_close(logits, want_logits, **TOLERANCE)
    assert (routes == want_routes).all()
    if DEVICE == "cpu":
        assert (logits.argmax(-1) == want_logits.argmax(-1)).all()


@pytest.mark.skipif(DEVICE != "cpu", reason="fp32 tokens: the CPU run under the interpreter")
@pytest.mark.parametrize("name", list(MODELS))
def test_triton_backend_generates_the_torch_backends_tokens(name, monkeypatch):
    """The engine's triton backend (the eager layers with every Triton step, its prefill and
    decode never in the model's moe_experts) against its torch backend: greedy tokens and
    routing records equal in fp32."""
    model = _on_device(name)
    prompts = [[5, 17, 9, 33, 2, 71, 5, 17, 9, 33], [40, 41], [12]]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        options = EngineOptions(decode_backend=backend, cuda_graphs=False)
        engine = Engine(model, len(prompts), 32, options=options)
        assert engine.decode_backend == "torch"  # the eager layers, their steps on `backend`
        assert engine.recurrent_step == backend
        if backend == "triton":
            _forbid_model_experts(monkeypatch)
        results[backend] = engine.generate(prompts, params)
    for got, want in zip(results["triton"], results["torch"]):
        assert got.token_ids == want.token_ids
        assert (got.routed_experts == want.routed_experts).all()


def test_a_ranks_share_of_the_fp8_experts_sums_to_the_whole_layer():
    """A tensor-parallel rank's share of the experts (models/moe.ExpertSlice) on the W_FP8
    grouped kernels (layers/moe.fp8_routed_experts): its copies' experts, the pairs routed
    elsewhere skipped, the output handed to the group's all-reduce. The two shares, run in
    one process and added (what the all-reduce of 2 ranks does), give the whole layer's
    output."""
    from types import SimpleNamespace
    from unittest import mock

    from hybridflow.engine.fp8.experts import Fp8ExpertWeights, quantize_experts_into
    from hybridflow.engine.kernels.experts import routing
    from hybridflow.engine.layers.moe import fp8_routed_experts
    from hybridflow.models.moe import ExpertSlice

    def quantized(weight):
        values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
        scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=DEVICE)
        quantize_experts_into(weight, values, scale)
        return values, scale

    experts, top_k, hidden, inner, tokens = 8, 2, 64, 32, 16
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE, dtype)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=generator) * 0.05).to(
        DEVICE, dtype
    )
    down = (torch.randn(experts, hidden, inner, generator=generator) * 0.05).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=generator).to(DEVICE)
    ids, weights = routing.route_topk(logits, top_k, renormalize=True)
    whole = Fp8ExpertWeights(*quantized(gate_up), *quantized(down))
    layer = SimpleNamespace(experts=SimpleNamespace(gate_up_proj=gate_up, down_proj=down))
    expected = fp8_routed_experts(layer, x, ids, weights, whole, grouped=True).float()
    share, group = experts // 2, object()
    parts = []
    with mock.patch("torch.distributed.all_reduce") as all_reduce:
        for first in (0, share):
            held = slice(first, first + share)
            rank = SimpleNamespace(experts=SimpleNamespace(gate_up_proj=gate_up[held],
                                                           down_proj=down[held]),
                                   expert_slice=ExpertSlice(first, group))  # fmt: skip
            copies = Fp8ExpertWeights(*(tensor[held] for tensor in whole))
            parts.append(fp8_routed_experts(rank, x, ids, weights, copies, grouped=True))
    assert all_reduce.call_count == 2
    assert all(call.kwargs["group"] is group for call in all_reduce.call_args_list)
    got = parts[0].float() + parts[1].float()
    # fp32: the pairs' sums in another order; bf16: each share's output rounded before the sum
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < (1e-5 if DEVICE == "cpu" else 1e-2)
