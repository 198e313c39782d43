"""The hybrid engine on CUDA (tiny-hybrid, fp32): the fused Gated DeltaNet decode step
captured in CUDA graphs samples the eager path's tokens (the torch step, no graphs), with n
samples copying the prompt's state, preemption rebuilding it and mixed steps carrying it.

    pytest -m gpu tests/engine/test_hybrid_engine_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [12], [100, 3, 8, 19, 23, 60, 61]]


@pytest.fixture(scope="module")
def hybrid():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny-hybrid"), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.cuda()


def _engine(model, graphs: bool, slots=8, budget=None, per_step=0, cap=True) -> Engine:
    backend = "triton" if graphs else "torch"
    options = EngineOptions(decode_backend=backend, cuda_graphs=graphs, kv_block_size=16,
                            max_prefill_tokens_per_step=per_step,
                            cap_state_slots=cap)  # fmt: skip
    return Engine(model, slots, 96, memory_budget=budget, options=options)


def _assert_same(got, expected):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("per_step", [0, 5])
def test_graphed_fused_steps_sample_the_eager_paths_tokens(hybrid, per_step):
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=24, seed=3, ignore_eos=True)
    eager = _engine(hybrid, graphs=False)
    graphed = _engine(hybrid, graphs=True, per_step=per_step)
    assert graphed.recurrent_step == "triton" and graphed.cuda_graphs
    _assert_same(graphed.generate(PROMPTS, params), eager.generate(PROMPTS, params))
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=24, ignore_eos=True)
    _assert_same(graphed.generate(PROMPTS, greedy), eager.generate(PROMPTS, greedy))


def test_graphed_steps_through_preemption_sample_the_eager_paths_tokens(hybrid):
    """14 blocks of 16 for 8 sequences growing to 2-4 blocks: preempted rows are prefilled
    again (their states rebuilt) while the others step on in graphs. The slots pinned
    (cap=False): capped ones always have the blocks to finish."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=5, ignore_eos=True)
    reference = _engine(hybrid, graphs=False)
    expected = reference.generate(PROMPTS, params)
    cache = reference.cache
    block_bytes = cache.keys[:, 0].numel() * cache.keys.element_size() * 2
    budget = block_bytes * 15 + cache.states.nbytes()
    engine = _engine(hybrid, graphs=True, budget=budget, cap=False)
    got = engine.generate(PROMPTS, params)
    assert engine.cache.num_blocks == 14 and engine.scheduler.paging.preemptions > 0
    _assert_same(got, expected)
