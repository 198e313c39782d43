"""The engine on a mixture-of-experts model (the tiny-moe preset, fp32, CPU): the torch
backend against the model's own forward, the routing record against the model's routing,
its layout for the trainer. The triton backend's MoE path: tests/engine/kernels/
test_moe_engine_fused.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.scheduling.routes import padded_routes
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12]]


@pytest.fixture(scope="module")
def moe_model():
    """tiny-moe (a dense first layer, then sparse ones) with std-0.3 weights: peaked logits
    and routers far from ties."""
    generator = torch.Generator().manual_seed(2)
    model = build_model(preset_config("tiny-moe"), seed=2).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            p.normal_(0, 0.3, generator=generator)
    return model


def model_routes(model, ids: list[int]) -> np.ndarray:
    """The model's own routing of a sequence: [len, L_sparse, k] (one packed forward)."""
    tokens = torch.tensor(ids)
    trace = []
    model.forward_packed(tokens, torch.arange(len(ids)),
                         torch.tensor([0, len(ids)], dtype=torch.int32), len(ids),
                         router_trace=trace)  # fmt: skip
    return torch.stack([topk_ids for _, topk_ids in trace], dim=1).numpy()


@pytest.mark.parametrize("block", [64, 16, None])  # paged (one block, several), slot cache
def test_torch_backend_greedy_matches_forward_and_records_the_models_routes(moe_model, block):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10, ignore_eos=True)
    options = EngineOptions(decode_backend="torch", kv_block_size=block)
    engine = Engine(moe_model, max_batch_size=3, max_seq_len=64, options=options)
    completions = engine.generate(PROMPTS, params)  # 8 requests through 3 slots: reuse
    for i, completion in enumerate(completions):
        prompt = PROMPTS[i // 2]
        ids = prompt + completion.token_ids
        logits = moe_model(torch.tensor([ids[:-1]]))[0]
        assert completion.token_ids == logits[len(prompt) - 1 :].argmax(-1).tolist()
        record = completion.routed_experts
        assert record.dtype == np.uint8 and record.shape == (len(ids) - 1, 3, 2)
        expected = model_routes(moe_model, ids[:-1])
        assert np.array_equal(record, expected)


def test_no_record_when_off_or_dense(moe_model, model):
    params = SamplingParams(temperature=0, max_new_tokens=3)
    off = EngineOptions(decode_backend="torch", record_routes=False)
    assert (
        Engine(moe_model, 2, 32, options=off).generate([[1, 2]], params)[0].routed_experts is None
    )
    dense = Engine(model, 2, 32, options=EngineOptions(decode_backend="torch"))
    assert dense.generate([[1, 2]], params)[0].routed_experts is None


def test_padded_routes_align_with_left_padded_prompts_and_right_padded_responses():
    # two requests: prompt 2 + 3 tokens (record of 4 rows), prompt 3 + 1 token (3 rows)
    first = np.arange(4 * 2 * 1, dtype=np.uint8).reshape(4, 2, 1)
    second = np.full((3, 2, 1), 7, dtype=np.uint8)
    routed = padded_routes([first, second], [2, 3], prompt_width=3, response_width=4)
    assert routed.shape == (2, 7, 2, 1) and routed.dtype == torch.int16
    assert routed[0, :, 0, 0].tolist() == [-1, 0, 2, 4, 6, -1, -1]  # pad, prompt, 2 responses
    assert routed[1, :, 1, 0].tolist() == [7, 7, 7, -1, -1, -1, -1]  # the last token: -1


def test_unmerged_expert_adapters_decode_as_the_model_runs_them():
    """An ExpertLoRA attached and on: the engine runs the model's own grouped path with it."""
    from hybridflow.models.moe import ExpertLoRA

    model = build_model(preset_config("tiny-moe"), seed=4).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(4)
    for p in model.parameters():
        p.normal_(0, 0.3, generator=generator)
    for layer in model.model.layers:
        if layer.sparse:
            lora = ExpertLoRA(layer.mlp.experts, rank=4, alpha=8.0, generator=generator)
            for factor in (lora.gate_up_B, lora.down_B):  # B = 0 would change nothing
                factor.data.normal_(0, 0.3, generator=generator)
            layer.mlp.experts.lora = lora.requires_grad_(False)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    engine = Engine(model, 2, 32, options=EngineOptions(decode_backend="torch"))
    prompt = PROMPTS[0]
    tokens = engine.generate([prompt], params)[0].token_ids
    logits = model(torch.tensor([prompt + tokens[:-1]]))[0]
    assert tokens == logits[len(prompt) - 1 :].argmax(-1).tolist()
