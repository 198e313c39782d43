"""The paged KV cache on the fused path (Triton decode and shared-prefix attention through the
block table, CUDA graphs on a GPU): n = 3 samples sharing their prompts' blocks, and a budget
small enough to preempt, each sample what the eager slot-cache engine samples. fp32 tiny
model. Runs on CUDA (marked gpu), or on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

# 18 tokens (a full block of 16 and a partial one) and 2
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41]]


def _model():
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    return model.requires_grad_(False)


def test_paged_fused_engine_samples_as_the_eager_slot_cache():
    """12 blocks for 6 sequences that need 13 (34 or 18 tokens: 2-3 blocks each, the first
    prompt's full block shared): some are preempted."""
    model, blocks, prompts = _model(), 12, PROMPTS
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=16, seed=3, ignore_eos=True)
    eager = Engine(model, 12, 96, options=EngineOptions(decode_backend="torch",
                                                        cuda_graphs=False))  # fmt: skip
    expected = eager.generate(prompts, params)
    block_bytes = eager.cache.keys[:, 0, :16].numel() * 4 * 2
    budget = block_bytes * (blocks + 1)
    paged = Engine(model, 12, 96, memory_budget=budget,
                   options=EngineOptions(decode_backend="triton", kv_block_size=16))  # fmt: skip
    got = paged.generate(prompts, params)
    assert paged.cache.num_blocks == blocks and paged.scheduler.paging.preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="graphs are captured on CUDA only")
def test_warm_up_captures_the_graphs_a_call_with_samples_uses():
    """n > 1 decodes with shared-prefix attention: Engine.warm_up captures those graphs, so
    the call itself captures none."""
    engine = Engine(_model(), 16, 96, options=EngineOptions(kv_block_size=16))
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True)
    assert engine.warm_up(params) > 0
    warmed, before = set(engine.runner.graphs), engine.runner.captures
    engine.generate(PROMPTS, params)
    # the keys (bucket, (sampling mode, shared)) name what the call captured, if it did
    assert set(engine.runner.graphs) - warmed == set()
    assert engine.runner.captures == before
