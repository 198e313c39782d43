"""Mixed steps on the fused path (mixed.py through extend_forward_triton: decode rows and
prompt chunks in one forward, a paged cache's block table, n = 2 samples sharing blocks):
each sample what the eager engine's separate passes sample. fp32 tiny model. Runs on CUDA
(marked gpu), or on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [100, 3, 8, 19, 23, 60, 61]]


def _model():
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    return model.requires_grad_(False)


def test_fused_mixed_steps_sample_as_the_eager_separate_passes():
    model = _model()
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=10, seed=3, ignore_eos=True)
    eager = Engine(model, 4, 64, options=EngineOptions(decode_backend="torch",
                                                       cuda_graphs=False))  # fmt: skip
    budgets = [4, 4, 10, 10, 6, 6]  # the first prompt's rows leave early: the last joins
    expected = eager.generate(PROMPTS, params, max_new_tokens=budgets)
    fused = Engine(model, 4, 64, options=EngineOptions(
        decode_backend="triton", kv_block_size=16, steps_per_sync=2,
        max_prefill_tokens_per_step=8))  # fmt: skip
    got = fused.generate(PROMPTS, params, max_new_tokens=budgets)
    assert fused.scheduler.mixed_steps > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
