"""DeepSeek-V3's decode on CUDA (tiny-deepseek-v3): the absorbed attention's Triton kernel over
the paged latent cache captured in the engine's CUDA graphs samples what the same steps run
eagerly sample, in fp32 and in bf16, with n samples sharing a prompt's blocks.

    pytest -m gpu tests/engine/test_latent_engine_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [12], [100, 3, 8, 19, 23, 60, 61]]


def _model(dtype):
    """std-0.3 weights: peaked logits, greedy far from ties."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny-deepseek-v3"), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.to("cuda", dtype)


def _generate(model, graphs: bool, params: SamplingParams):
    options = EngineOptions(cuda_graphs=graphs, kv_block_size=16)
    engine = Engine(model, max_batch_size=8, max_seq_len=96, options=options)
    assert engine.native and engine.recurrent_step == "triton"  # the kernel decodes
    results = engine.generate(PROMPTS, params)
    assert engine.runner.captures > 0 if graphs else engine.runner.captures == 0
    return results


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_graphs_sample_what_eager_steps_sample(dtype, atol):
    model = _model(dtype)
    for params in (
        SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True),
        SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=3, ignore_eos=True),
    ):
        eager = _generate(model, False, params)
        graphed = _generate(model, True, params)
        assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
        for a, b in zip(graphed, eager):
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)
            assert (a.routed_experts == b.routed_experts).all()


def test_the_kernels_tokens_are_the_torch_steps_in_fp32():
    """Under graphs, the kernel's greedy tokens equal the torch step's (the reference)."""
    model = _model(torch.float32)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True)
    graphed = _generate(model, True, params)
    options = EngineOptions(decode_backend="torch", cuda_graphs=False, kv_block_size=16)
    torch_steps = Engine(model, 8, 96, options=options).generate(PROMPTS, params)
    assert [c.token_ids for c in graphed] == [c.token_ids for c in torch_steps]
