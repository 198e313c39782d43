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


@pytest.mark.skipif(DEVICE != "cuda", reason="FlashAttention runs on CUDA in 16-bit")
def test_bf16_mixed_steps_run_flash_chunks_beside_decode_rows_and_agree_with_passes():
    """In bf16 the chunks attend through FlashAttention and the decode rows through the
    decode kernel, in one forward; the first tokens agree with separate passes to bf16
    rounding (other matmul shapes)."""
    from torch.profiler import ProfilerActivity, profile

    model = _model().to(torch.bfloat16)
    greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    budgets = [3, 10, 8]  # the first row leaves early: the last prompt joins decoding rows
    # 16-token blocks: with the default 64 a 2-slot cache of 64 tokens is 2 blocks, and the
    # last prompt would wait for a block until both rows had finished (no mixed step)
    firsts = {}
    for per_step in (0, 8):
        engine = Engine(model, 2, 64, options=EngineOptions(
            decode_backend="triton", steps_per_sync=2, kv_block_size=16,
            max_prefill_tokens_per_step=per_step))  # fmt: skip
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = engine.generate(PROMPTS, greedy, max_new_tokens=budgets)
            torch.cuda.synchronize()
        kernels = " ".join(event.key for event in prof.key_averages())
        firsts[per_step] = [(c.token_ids[0], c.logprobs[0]) for c in out]
        if per_step:
            assert engine.scheduler.mixed_steps > 0
            assert "flash" in kernels and "_decode_attention" in kernels
    for (token, logprob), (ref_token, ref_logprob) in zip(firsts[8], firsts[0]):
        assert token == ref_token and abs(logprob - ref_logprob) < 0.05
