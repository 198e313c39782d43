"""The fp8 rollout's routed experts on a GPU (fp8/experts.py, kernels/experts/moe.py's W_FP8 path):
the grouped kernels over e4m3 weights at a Qwen3-30B-A3B layer's width against torch over the
dequantized weights, in bf16; tiny-moe's fp8 engine with CUDA graphs samples what it samples
eagerly, stays near the bf16 engine, and replays a weight sync's re-quantized experts."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.fp8.experts import quantize_experts_into
from hybridflow.engine.kernels.experts import moe, routing
from hybridflow.models import build_model
from hybridflow.models.moe import moe_experts
from hybridflow.models.presets import preset_config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("e4m3 converts need sm_89+", allow_module_level=True)

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [12], [100, 3, 8, 19, 23, 60, 61]]


def _quantized(weight):
    values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
    quantize_experts_into(weight, values, scale)
    return values, scale


@pytest.mark.parametrize("tokens", [16, 256, 2048])  # decode blocks of 16 and 32, prefill's
def test_fp8_grouped_kernels_match_torch_over_the_dequantized_weights(tokens):
    experts, top_k, hidden, inner = 16, 8, 2048, 768  # Qwen3-30B-A3B's widths, 16 experts
    generator = torch.Generator("cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
    gate_up = (torch.randn(experts, 2 * inner, hidden, device="cuda", generator=generator)
               * 0.02).bfloat16()  # fmt: skip
    down = (torch.randn(experts, hidden, inner, device="cuda", generator=generator)
            * 0.02).bfloat16()  # fmt: skip
    logits = torch.randn(tokens, experts, device="cuda", generator=generator)
    ids, weights = routing.route_topk(logits, top_k, renormalize=True)
    (gate_up8, gate_up_scale), (down8, down_scale) = _quantized(gate_up), _quantized(down)
    blocks = moe.align_pairs(ids, experts, moe.block_rows(tokens, top_k, experts))
    act = moe.grouped_gate_up(x, gate_up8, blocks, scale=gate_up_scale)
    out = moe.combine(moe.grouped_down(act, down8, blocks, scale=down_scale), weights)
    # the reference rounds the dequantized weights to bf16 (the kernel scales fp32 sums)
    dequantized = [(v.float() * s[..., None]).bfloat16() for v, s in
                   ((gate_up8, gate_up_scale), (down8, down_scale))]  # fmt: skip
    expected = moe_experts(x, ids.long(), weights, *dequantized, "loop")
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert error.item() < 1e-2  # bf16 roundings of the weights and the activations


def _moe_model():
    model = build_model(preset_config("tiny-moe"), seed=3, device="cuda").eval()
    generator = torch.Generator("cuda").manual_seed(3)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            p.data.normal_(0, 0.3, generator=generator)
    return model.bfloat16().requires_grad_(False)


def test_fp8_moe_engine_graphs_sample_as_eager_and_near_bf16():
    model = _moe_model()
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=16, seed=4, ignore_eos=True)
    got = {}
    for graphs in (False, True):
        options = EngineOptions(decode_backend="triton", weight_format="fp8", cuda_graphs=graphs)
        engine = Engine(model, max_batch_size=8, max_seq_len=64, options=options)
        got[graphs] = engine.generate(PROMPTS, params)
        assert sorted(engine.fp8.experts.layers) == [1, 2, 3]
    assert [c.token_ids for c in got[True]] == [c.token_ids for c in got[False]]
    greedy = SamplingParams(temperature=0, max_new_tokens=1)
    bf16 = Engine(model, 8, 64, options=EngineOptions(decode_backend="triton"))
    gaps = [
        abs(a.logprobs[0] - b.logprobs[0])  # the prefill's first token
        for a, b in zip(engine.generate(PROMPTS, greedy), bf16.generate(PROMPTS, greedy))
    ]
    assert max(gaps) < 0.5  # fp32 on the CPU (the interpreter): 0.23 at most, 0.11 mean
    # a weight sync: the copies are re-quantized in place, the captured graphs read them
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.experts.down_proj.mul_(-1.0)
    engine.weights_updated()
    synced = engine.generate(PROMPTS, params)
    fresh = Engine(model, max_batch_size=8, max_seq_len=64,
                   options=EngineOptions(decode_backend="triton", weight_format="fp8",
                                         cuda_graphs=False)).generate(PROMPTS, params)  # fmt: skip
    assert [c.token_ids for c in synced] == [c.token_ids for c in fresh]


def test_expert_quantization_on_cuda_is_the_dense_copies_quantize_weight():
    """quantize_experts_into runs the Triton row quantizer on CUDA: the bytes and scales of
    weight_scales.quantize_weight (the dense copies'), bit for bit."""
    from hybridflow.engine.fp8.weight_scales import quantize_weight

    weight = (torch.randn(6, 1536, 2048, device="cuda") * 0.02).bfloat16()
    weight[2, 5] *= 300.0
    values, scale = _quantized(weight)
    expected, expected_scale = quantize_weight(weight.flatten(0, 1), "engine")
    assert torch.equal(values.flatten(0, 1).view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scale.flatten(), expected_scale.flatten())
