"""The fp8 rollout of the eager layer kinds on a GPU (engine/fp8/linears.py): for each family's
tiny preset in bf16 (Qwen3.5 dense and MoE, DeepSeek-V3, GPT-OSS), the engine on its speed
path (the Triton steps of the recurrent, latent and sink layers, torch._scaled_mm for the
projections, the W_FP8 grouped kernels for the routed experts, decode steps replayed as
CUDA graphs) samples what it samples eagerly, stays near the bf16 engine, holds half the
bytes of the projections it quantizes, and replays a weight sync's re-quantized copies."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.fp8.linears import eager_linears
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("fp8 matmuls need sm_89+", allow_module_level=True)

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [12], [100, 3, 8, 19, 23, 60, 61]]
SAMPLED = SamplingParams(n=2, temperature=0.9, max_new_tokens=16, seed=4, ignore_eos=True)


def _config(preset: str):
    if preset == "tiny-hybrid-moe":  # Qwen3.5-MoE: routed experts beside a shared expert
        return preset_config("tiny-hybrid").replace(
            model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
        )  # fmt: skip
    if preset == "tiny-deepseek-v3":  # kv_a_proj_with_mqa: 40 + 8 rows, fp8-sized
        return preset_config(preset).replace(kv_lora_rank=40)
    return preset_config(preset)


def _model(preset: str):
    model = build_model(_config(preset), seed=3, device="cuda").eval()
    generator = torch.Generator("cuda").manual_seed(3)
    for p in model.parameters():
        p.data.normal_(0, 0.1, generator=generator)
    return model.bfloat16().requires_grad_(False)


def _fp8(graphs: bool) -> EngineOptions:
    return EngineOptions(weight_format="fp8", cuda_graphs=graphs)


@pytest.mark.parametrize("preset",
                         ["tiny-hybrid", "tiny-hybrid-moe", "tiny-deepseek-v3", "tiny-gpt-oss"])  # fmt: skip
def test_fp8_eager_engine_graphs_sample_as_eager_and_near_bf16(preset):
    model = _model(preset)
    got = {}
    for graphs in (False, True):
        engine = Engine(model, max_batch_size=8, max_seq_len=64, options=_fp8(graphs))
        assert engine.eager_layers and engine.recurrent_step == "triton"
        got[graphs] = engine.generate(PROMPTS, SAMPLED)
    assert [c.token_ids for c in got[True]] == [c.token_ids for c in got[False]]
    quantized = sum(linear.weight.numel() for linear in eager_linears(model))
    assert engine.fp8.nbytes() - engine.fp8.experts.nbytes() < 0.55 * 2 * quantized
    greedy = SamplingParams(temperature=0, max_new_tokens=1)
    bf16 = Engine(model, 8, 64)
    gaps = [
        abs(a.logprobs[0] - b.logprobs[0])  # the prefill's first token
        for a, b in zip(engine.generate(PROMPTS, greedy), bf16.generate(PROMPTS, greedy))
    ]
    assert max(gaps) < 0.5
    with torch.no_grad():  # a weight sync in place: the graphs read the re-quantized copies
        for layer in model.model.layers:
            mixer = getattr(layer, layer.mixer_name)
            getattr(mixer, "o_proj", getattr(mixer, "out_proj", None)).weight.mul_(-1.0)
    engine.weights_updated()
    synced = engine.generate(PROMPTS, SAMPLED)
    fresh = Engine(model, 8, 64, options=_fp8(False)).generate(PROMPTS, SAMPLED)
    assert [c.token_ids for c in synced] == [c.token_ids for c in fresh]
    assert [c.token_ids for c in synced] != [c.token_ids for c in got[True]]
