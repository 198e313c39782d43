"""The rollout service on the fused path (Triton kernels, CUDA graphs on a GPU): requests
with different settings in one batch, one with a stop token only it has, and a submission
of n = 2 samples (shared-prefix attention) joining while others decode, each sample what
the eager engine samples for it alone. fp32 tiny model (bf16 rounding could flip a sample
between batch shapes). Runs on CUDA (marked gpu), or on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, RolloutService, SamplingParams  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12],
           [8, 8, 9]]  # fmt: skip


def _model():
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    return model.requires_grad_(False)


def test_mixed_settings_and_a_joining_group_sample_as_the_eager_engine_alone():
    model = _model()
    eager = Engine(model, 8, 64, options=EngineOptions(decode_backend="torch",
                                                       cuda_graphs=False))  # fmt: skip
    plain = SamplingParams(temperature=1.0, max_new_tokens=14, ignore_eos=True)
    stop_at = eager.generate([PROMPTS[2]], plain, seeds=[3])[0].token_ids[5]
    settings = [
        SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, max_new_tokens=9, ignore_eos=True),
        SamplingParams(
            temperature=1.0, stop_token_ids=(stop_at,), max_new_tokens=14, ignore_eos=True
        ),  # fmt: skip
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, max_new_tokens=11, ignore_eos=True),
    ]
    seeds = [1, 2, 3, 4, 5]
    group = SamplingParams(n=2, temperature=0.9, max_new_tokens=8, ignore_eos=True)
    expected = [eager.generate([p], s, seeds=[seed])[0]
                for p, s, seed in zip(PROMPTS, settings, seeds)]  # fmt: skip
    expected_group = eager.generate([PROMPTS[0]], group, seeds=[9])
    fast = Engine(model, 8, 64, options=EngineOptions(decode_backend="triton", steps_per_sync=2))
    captured = fast.warm_up(settings[1])  # every bucket's graph now (none on the interpreter)
    assert captured == (len(fast.runner.buckets) if DEVICE == "cuda" else 0)
    with RolloutService(fast) as service:
        service.pause()  # admitted together: one batch of mixed settings
        handles = [service.submit(p, s, seed=seed, stream=i == 0)
                   for i, (p, s, seed) in enumerate(zip(PROMPTS, settings, seeds))]  # fmt: skip
        service.resume()
        next(iter(handles[0].stream(timeout=120)))  # decoding: now the group joins
        joined = service.submit(PROMPTS[0], group, seed=9)
        got = [h.result(timeout=120)[0] for h in handles]
        got_group = joined.result(timeout=120)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.token_ids for c in got_group] == [c.token_ids for c in expected_group]
    assert got[2].finish_reason == "stop" and got[2].token_ids[-1] == stop_at
    for a, b in zip(got + got_group, expected + expected_group):
        assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) < 1e-4
