"""The engine with fp8 matmuls (EngineOptions.weight_format="fp8") on the fused path: it
generates through the fp8 copies, its log-probs stay near the model-dtype engine's, and a
weight update reaches the copies. Runs on CUDA (marked gpu; bf16, with the Triton activation
quantizer checked against the reference), or on CPU under TRITON_INTERPRET=1 (fp32)."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.engine.fp8.e4m3 import quantize_rows_reference  # noqa: E402
from hybridflow.engine.fp8.rows import quantize_rows  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12]]


def _model():
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    return model.to(DTYPE).requires_grad_(False)


def test_fp8_engine_samples_near_the_model_dtype_engine_and_follows_weight_updates():
    model = _model()
    # 3 tokens: the checks read the first token's log-prob (the prefill) and whether any
    # log-prob differs; the decode steps after it only cost interpreter time
    greedy = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    results = {}
    for fmt in ("model", "fp8"):
        engine = Engine(model, 4, 64, options=EngineOptions(decode_backend="triton",
                                                            weight_format=fmt))  # fmt: skip
        results[fmt] = engine.generate(PROMPTS, greedy)
        if fmt == "fp8":
            assert engine.fp8 is not None and engine.fp8.copies
            fp8_engine = engine
    # the first token's log-prob comes from the prefill alone: same prompt, nearby value
    for a, b in zip(results["fp8"], results["model"]):
        assert abs(a.logprobs[0] - b.logprobs[0]) < 0.25
    assert any(a.logprobs != b.logprobs for a, b in zip(results["fp8"], results["model"]))

    with torch.no_grad():  # a training step in place: the next call quantizes it afresh
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.0)
    fp8_engine.weights_updated()
    flipped = fp8_engine.generate(PROMPTS, greedy)
    reference = Engine(model, 4, 64, options=EngineOptions(decode_backend="triton"))
    expected = reference.generate(PROMPTS, greedy)
    for a, b in zip(flipped, expected):
        assert abs(a.logprobs[0] - b.logprobs[0]) < 0.25


@pytest.mark.skipif(DEVICE != "cuda", reason="on the CPU quantize_rows is the reference")
def test_the_triton_activation_quantizer_matches_the_reference():
    x = torch.randn(37, 4864, device=DEVICE, dtype=torch.bfloat16) * 3
    x[5] = 0
    got, scale = quantize_rows(x)
    want, want_scale = quantize_rows_reference(x)
    assert torch.equal(scale, want_scale)  # IEEE divisions in the kernel, as in torch
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_fp8_engine_with_the_trainers_scales_quantizes_the_models_own_weights():
    from hybridflow.engine.fp8.weight_scales import quantize_weight

    model = _model()
    greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    expected = Engine(model, 4, 64, options=EngineOptions(decode_backend="triton")).generate(
        PROMPTS[:2], greedy
    )
    for recipe in ("rowwise", "tensorwise"):
        options = EngineOptions(decode_backend="triton", weight_format="fp8",
                                fp8_weight_scales=recipe)  # fmt: skip
        engine = Engine(model, 4, 64, options=options)
        results = engine.generate(PROMPTS[:2], greedy)
        assert not engine.fused.folded  # the split layer applies the norm weights itself
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        _, qkv8, scale = engine.fp8.copies[engine.fused.qkv_weight[0].data_ptr()]
        values, q_scale = quantize_weight(q_proj, recipe)
        rows = q_proj.shape[0]
        assert torch.equal(qkv8[:rows].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(scale[0, :rows], q_scale[:, 0])
        for a, b in zip(results, expected):
            assert abs(a.logprobs[0] - b.logprobs[0]) < 0.25


def _moe_model():
    """tiny-moe (layer 0 dense, layers 1-3 of 8 routed experts) with weights that route and
    generate unevenly."""
    model = build_model(preset_config("tiny-moe"), seed=3, device=DEVICE).eval()
    generator = torch.Generator(DEVICE).manual_seed(3)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            p.data.normal_(0, 0.3, generator=generator)
    return model.to(DTYPE).requires_grad_(False)


def _quantized_experts(mlp):
    from hybridflow.engine.fp8.experts import quantize_experts_into

    out = []
    for weight in (mlp.experts.gate_up_proj, mlp.experts.down_proj):
        values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
        scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
        quantize_experts_into(weight, values, scale)
        out.append((values, scale))
    return out


@pytest.mark.slow  # ~25 s under the interpreter
def test_fp8_experts_generate_as_their_dequantized_weights_in_the_model_dtype(monkeypatch):
    """A mixture of experts under weight_format="fp8": its routed experts are e4m3 copies
    (fp8/experts.py) read by the grouped kernels. Against the same fp8 engine over a copy of
    the model whose experts hold the dequantized weights (values * scale) and run in the
    model's dtype (no expert copies), the only difference is the experts' quantization:
    the same greedy tokens, log-probs within the kernels' rounding. The dense layer's MLP
    and the attention projections take the dense fp8 path in both; a weight sync
    re-quantizes the experts in place."""
    import copy

    from hybridflow.engine.fp8 import experts as fp8_experts

    model = _moe_model()
    dequantized = copy.deepcopy(model)
    for layer in dequantized.model.layers[1:]:
        experts = layer.mlp.experts
        (gate_up8, gate_up_scale), (down8, down_scale) = _quantized_experts(layer.mlp)
        experts.gate_up_proj.copy_(gate_up8.float() * gate_up_scale[..., None])
        experts.down_proj.copy_(down8.float() * down_scale[..., None])
    greedy = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    options = EngineOptions(decode_backend="triton", weight_format="fp8")
    engine = Engine(model, 4, 64, options=options)
    got = engine.generate(PROMPTS[:2], greedy)
    assert sorted(engine.fp8.experts.layers) == [1, 2, 3]  # layer 0's MLP is dense
    dense_mlp = model.model.layers[0].mlp.down_proj.weight
    assert dense_mlp.data_ptr() in engine.fp8.copies
    with monkeypatch.context() as patch:  # the reference: experts in the model's dtype
        patch.setattr(fp8_experts, "expert_tensors", lambda layer: None)
        reference = Engine(dequantized, 4, 64, options=options)
        expected = reference.generate(PROMPTS[:2], greedy)
        assert not reference.fp8.experts.layers
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) < 1e-4
    copies = engine.fp8.experts.of(1)  # the kernels read e4m3 bytes, not the model's weights
    assert copies.gate_up.dtype == torch.float8_e4m3fn
    assert not torch.equal(copies.gate_up.float() * copies.gate_up_scale[..., None],
                           model.model.layers[1].mlp.experts.gate_up_proj.float())  # fmt: skip

    with torch.no_grad():  # a training step in place: the next call quantizes it afresh
        model.model.layers[2].mlp.experts.down_proj.mul_(-0.5)
    engine.weights_updated()
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=1))
    copies = engine.fp8.experts.of(2)
    (_, _), (down8, down_scale) = _quantized_experts(model.model.layers[2].mlp)
    assert torch.equal(copies.down.view(torch.uint8), down8.view(torch.uint8))
    assert torch.equal(copies.down_scale, down_scale)


def _eager_kind_model(preset: str):
    config = preset_config("tiny-hybrid")
    if preset == "tiny-hybrid-moe":  # Qwen3.5-MoE: routed experts beside a shared expert
        config = config.replace(model_type="qwen3_5_moe_text", num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=True)  # fmt: skip
    else:
        config = preset_config(preset).replace(kv_lora_rank=40)  # kv_a: 48 rows, fp8-sized
    model = build_model(config, seed=2).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(2)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


@pytest.mark.skipif(DEVICE == "cuda", reason="tests/engine/test_fp8_eager_gpu.py on CUDA")
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-hybrid-moe"])
def test_fp8_eager_layers_on_the_triton_steps_sample_as_on_the_torch_steps(preset):
    """The layers of the eager passes with fp8 projections (fp8/linears.py) on the Triton
    steps (the W_FP8 grouped kernels for the routed experts, the latent or delta-rule step)
    against the torch steps (the experts' copies widened back for the model's moe_experts):
    the same tokens, log-probs within fp32 noise."""
    model = _eager_kind_model(preset)
    greedy = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    results = {}
    for backend in ("triton", "auto"):  # auto: the torch steps on the CPU
        options = EngineOptions(decode_backend=backend, weight_format="fp8", cuda_graphs=False)
        engine = Engine(model, 1, 16, options=options)
        results[backend] = engine.generate(PROMPTS[:1], greedy)
        assert engine.fp8.experts.layers
    got, expected = results["triton"], results["auto"]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-3)
