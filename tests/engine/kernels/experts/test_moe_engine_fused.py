"""The triton backend on a mixture-of-experts model (tiny-moe, fp32) against the torch
backend: the same tokens, log-probs and routing record, through the fused kernels (decode,
prefill, the extend pass of a kept conversation). CUDA (marked gpu) or the CPU under
TRITON_INTERPRET=1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41, 100, 3, 8, 19, 23, 60, 61, 62, 63, 7]]


@pytest.fixture(scope="module")
def moe_model():
    model = build_model(preset_config("tiny-moe"), seed=3, device=DEVICE).eval()
    generator = torch.Generator(DEVICE).manual_seed(3)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            p.data.normal_(0, 0.3, generator=generator)
    return model.requires_grad_(False)


def _engines(model, **options):
    fast = Engine(model, max_batch_size=4, max_seq_len=32,
                  options=EngineOptions(decode_backend="triton", **options))  # fmt: skip
    eager = Engine(model, max_batch_size=6, max_seq_len=32,
                   options=EngineOptions(decode_backend="torch", cuda_graphs=False))  # fmt: skip
    return fast, eager


def _assert_same(a, b):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
        assert np.array_equal(x.routed_experts, y.routed_experts)


@pytest.mark.slow  # ~40 s under the interpreter
def test_fused_moe_engine_matches_eager_engine(moe_model):
    """n = 2: shared-prefix attention and the prompt's record fanned out to both samples."""
    fast, eager = _engines(moe_model)
    # 4 tokens: each decode step routes every row anew; more steps only add interpreter time
    params = SamplingParams(n=2, temperature=0.9, top_k=40, max_new_tokens=4, seed=3)
    _assert_same(fast.generate(PROMPTS, params), eager.generate(PROMPTS, params))


@pytest.mark.slow  # ~20 s under the interpreter
def test_kept_conversation_extends_with_the_same_tokens_and_record(moe_model):
    """A second turn through the extend pass (the kept slot's K/V and record reused)."""
    fast, eager = _engines(moe_model)
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    results = []
    for engine in (fast, eager):
        first = engine.generate(PROMPTS[:1], params, keep=True)
        follow = [p + c.token_ids + [7, 8] for p, c in zip(PROMPTS[:1], first)]
        results.append(engine.generate(follow, params, reuse=[c.kv_handle for c in first]))
    _assert_same(*results)
    record = results[0][0].routed_experts  # the whole conversation: both turns' tokens
    assert record.shape[0] == len(PROMPTS[0]) + 4 + 2 + 4 - 1
