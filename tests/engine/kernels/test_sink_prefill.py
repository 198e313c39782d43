"""GPT-OSS's prefill on the Triton step (prefill.prefill_forward, attention_step and
expert_step "triton"): the sink layers' attention through the packed prompts' kernel
(kernels/chunk_attention.packed_attention), the biased experts through their grouped path
(layers/biased_moe.py). In fp32 the logits of the model's own forward and the K/V of the
torch step, for packed prompts of different lengths, longer than the sliding window; the
engine's triton step prefills through both. On CUDA, the kernel and the prefill in bf16
(gpu-marked)."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

from hybridflow.engine.cache.sizing import make_cache
from hybridflow.engine.prefill import RopeTable, prefill_forward
from tests.engine.gpt_oss_helpers import gpt_oss_model

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
LENGTHS = [19, 3, 12, 9, 1]  # the sliding layer's window is 8


def _packed(vocab: int, device, seed: int = 5):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in LENGTHS]
    ends = torch.tensor(LENGTHS).cumsum(0)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    slots = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    tensors = (torch.cat(prompts), positions, slots, cu, ends - 1)
    return prompts, [t.to(device) for t in tensors]


def _prefill(model, step: str, dtype=torch.float32):
    cfg = model.config
    cache, _ = make_cache(cfg, len(LENGTHS), 32, None, None, 0, dtype, torch.device(DEVICE))
    prompts, (ids, positions, slots, cu, last) = _packed(cfg.vocab_size, DEVICE)
    rope = RopeTable(cfg, 32, dtype, ids.device)
    logits = prefill_forward(model, cache, rope, ids, positions, slots, cu, max(LENGTHS), last,
                             attention_step=step, expert_step=step)  # fmt: skip
    return prompts, logits, cache


@pytest.fixture(scope="module")
def gpt_oss():
    return gpt_oss_model().to(DEVICE)


def test_prefill_logits_equal_the_models_forward_and_the_cache_the_torch_steps(gpt_oss):
    prompts, logits, cache = _prefill(gpt_oss, "triton")
    for i, prompt in enumerate(prompts):
        expected = gpt_oss(prompt[None].to(DEVICE))[0, -1]
        torch.testing.assert_close(logits[i], expected, rtol=1e-5, atol=1e-5)
    _, torch_logits, torch_cache = _prefill(gpt_oss, "torch")
    torch.testing.assert_close(logits, torch_logits, rtol=1e-5, atol=1e-5)
    # the first layer's K/V bitwise (its inputs are), the second's through the first's output
    torch.testing.assert_close(cache.window.keys, torch_cache.window.keys, rtol=0, atol=0)
    torch.testing.assert_close(cache.keys, torch_cache.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.values, torch_cache.values, rtol=1e-5, atol=1e-5)


def test_the_engines_triton_step_prefills_through_the_kernel(gpt_oss, monkeypatch):
    """decode_backend='triton' (GPT-OSS decodes on the torch backend with the Triton steps):
    every sink layer of the prefill runs the packed kernel, every MLP of the prefill and of
    the decode steps the grouped experts, and greedy tokens past the window equal the
    model's own argmax."""
    from hybridflow.engine import Engine, EngineOptions, SamplingParams
    from hybridflow.engine.kernels import chunk_attention
    from hybridflow.engine.layers import biased_moe

    calls, grouped = [], []
    kernel = chunk_attention.packed_attention
    monkeypatch.setattr(chunk_attention, "packed_attention",
                        lambda *a, **k: calls.append(a[4]) or kernel(*a, **k))  # fmt: skip
    for name in ("biased_experts_grouped", "biased_experts_triton"):  # by the rows
        experts = getattr(biased_moe, name)
        monkeypatch.setattr(biased_moe, name,
                            lambda *a, f=experts: grouped.append(a[1].shape[0]) or f(*a))  # fmt: skip
    options = EngineOptions(decode_backend="triton", cuda_graphs=False, steps_per_sync=4)
    engine = Engine(gpt_oss, 4, 32, options=options)
    prompts = [[5, 17, 9, 33, 2, 71] * 2, [40, 41, 7]]
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    got = engine.generate(prompts, params)
    assert len(calls) == 2 and all(sinks is not None for sinks in calls)  # both layers, once
    # the prompts' tokens, then the last layer's last tokens, then both layers' 2 rows at
    # each of the 3 decode steps (all on the grouped Triton kernels, fp32 on CUDA too)
    assert grouped == [15, 2] + [2] * 6
    for prompt, completion in zip(prompts, got):
        tokens = list(prompt)
        for _ in range(4):
            tokens.append(int(gpt_oss(torch.tensor([tokens], device=DEVICE))[0, -1].argmax()))
        assert completion.token_ids == tokens[len(prompt) :]


def test_a_window_past_max_seq_len_reaches_the_kernel_as_max_seq_len(monkeypatch):
    """A 2**31 - 1-token window at max_seq_len 32: the sliding layer's packed kernel gets a
    window of 32 (layers/sink.attended_window), its ring 32 entries, and the greedy tokens
    (the decode steps reading that ring) are the model's own argmax."""
    from hybridflow.engine import Engine, EngineOptions, SamplingParams
    from hybridflow.engine.kernels import chunk_attention

    windows = []
    kernel = chunk_attention.packed_attention
    monkeypatch.setattr(chunk_attention, "packed_attention",
                        lambda *a, **k: windows.append(a[5]) or kernel(*a, **k))  # fmt: skip
    model = gpt_oss_model(window=2**31 - 1).to(DEVICE)
    options = EngineOptions(decode_backend="triton", cuda_graphs=False, steps_per_sync=4)
    engine = Engine(model, 4, 32, options=options)
    prompts = [[5, 17, 9, 33, 2, 71] * 2, [40, 41, 7]]
    got = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=4,
                                                  ignore_eos=True))  # fmt: skip
    assert windows == [32, 0] and engine.cache.window.keys.shape[2] == 32
    for prompt, completion in zip(prompts, got):
        tokens = list(prompt)
        for _ in range(4):
            tokens.append(int(model(torch.tensor([tokens], device=DEVICE))[0, -1].argmax()))
        assert completion.token_ids == tokens[len(prompt) :]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_in_bf16_on_cuda_is_the_torch_steps_prefill(gpt_oss):
    """The bf16 kernel against the model's attention of the same bf16 q/k/v (fp32 softmax),
    at gpt-oss-20b's heads; the bf16 prefill's logits as far from the fp32 ones as the torch
    step's."""
    from hybridflow.engine.kernels.chunk_attention import (
        packed_attention,
        packed_tiles,
        tile_tokens,
    )
    from hybridflow.models.mixers.sink_attention import sink_attention_packed

    generator = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim = sum(LENGTHS) * 40, 64, 8, 64  # gpt-oss-20b's heads
    q = torch.randn(tokens, heads, dim, generator=generator).cuda().bfloat16()
    k, v = (torch.randn(tokens, kv_heads, dim, generator=generator).cuda().bfloat16()
            for _ in range(2))  # fmt: skip
    sinks = torch.randn(heads, generator=generator).cuda().bfloat16()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).mul(40).cumsum(0).tolist()], device="cuda",
                      dtype=torch.int32)  # fmt: skip
    layout = packed_tiles(cu, tokens, tile_tokens(heads, kv_heads))
    for window in (128, 0):
        got = packed_attention(q, k, v, layout, sinks, window)
        expected = sink_attention_packed(q, k, v, sinks, window, cu)
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    reference = _prefill(gpt_oss, "torch")[1]  # fp32
    model = gpt_oss.to(torch.bfloat16)
    try:
        gaps = {step: (_prefill(model, step, torch.bfloat16)[1].float() - reference).abs().max()
                for step in ("triton", "torch")}  # fmt: skip
    finally:
        gpt_oss.float()
    assert gaps["triton"] <= 2 * gaps["torch"] + 1e-2  # within the torch step's bf16 gap
