"""The decode attention kernel with a sink logit per head (GPT-OSS; kernels/attention.py
HAS_SINK) against the engine's torch form (layers/sink.sink_softmax): slot and paged caches,
one split or several, a shared prefix, and sinks large enough to take most of the weight."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

from hybridflow.engine.layers.sink import sink_softmax

pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []
SEQ, KV_HEADS, HEADS, DIM = 64, 2, 6, 16


@pytest.fixture(scope="module")
def device():
    return triton_test_device()  # skips without CUDA or TRITON_INTERPRET=1


def _case(device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(5, SEQ, KV_HEADS, DIM, generator=generator).to(device)
                    for _ in range(2))  # fmt: skip
    q = torch.randn(4, HEADS, DIM, generator=generator).to(device)
    row_slots = torch.tensor([3, 0, 4, 1], device=device)
    lengths = torch.tensor([1, 17, 40, SEQ], device=device)
    sinks = (torch.randn(HEADS, generator=generator) * 3).to(device)  # some above the scores
    return q, keys, values, row_slots, lengths, sinks


def _reference(q, keys, values, row_slots, lengths, sinks):
    visible = torch.arange(SEQ, device=q.device)[None, :] < lengths[:, None]
    return sink_softmax(q, keys[row_slots], values[row_slots], visible, sinks)


@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_join_the_softmax_denominator(device, splits):
    from hybridflow.engine.kernels import attention

    q, keys, values, row_slots, lengths, sinks = _case(device, splits)
    got = attention.decode_attention(q, keys, values, row_slots, lengths, SEQ, splits=splits,
                                     autotune=False, sinks=sinks)  # fmt: skip
    expected = _reference(q, keys, values, row_slots, lengths, sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    plain = attention.decode_attention(q, keys, values, row_slots, lengths, SEQ, splits=splits,
                                       autotune=False)  # fmt: skip
    assert (got - plain).abs().max() > 1e-2  # the sinks changed the output


def test_sinks_through_a_paged_cache(device):
    from hybridflow.engine.kernels import attention

    q, keys, values, row_slots, lengths, sinks = _case(device, 7)
    block = 16
    blocks = keys.reshape(-1, block, KV_HEADS, DIM)  # slot s's blocks s*4 .. s*4 + 3, in order
    table = torch.arange(blocks.shape[0], device=device, dtype=torch.int32).view(5, -1)
    got = attention.decode_attention(q, blocks, values.reshape(blocks.shape), row_slots,
                                     lengths, SEQ, autotune=False, table=table,
                                     sinks=sinks)  # fmt: skip
    expected = _reference(q, keys, values, row_slots, lengths, sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_sinks_with_a_shared_prefix(device):
    """Rows 0 and 1 share slot 0's first 16 positions (read once by the prefix kernel): the
    sink is folded once a row, not once per part."""
    from hybridflow.engine.kernels import attention
    from hybridflow.engine.kernels.shared_prefix import group_table

    q, keys, values, _, _, sinks = _case(device, 11)
    keys[1, :16], values[1, :16] = keys[0, :16], values[0, :16]
    row_slots = torch.tensor([0, 1], device=device)
    lengths = torch.tensor([30, 41], device=device)
    groups, first = group_table([0, 0], [16, 16], [0, 1], capacity=2)
    got = attention.decode_attention(q[:2], keys, values, row_slots, lengths, SEQ, splits=1,
                                     autotune=False, shared=(first.to(device), groups.to(device)),
                                     sinks=sinks)  # fmt: skip
    expected = _reference(q[:2], keys, values, row_slots, lengths, sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [None, 16])
def test_the_engine_decodes_gpt_oss_through_the_kernel_as_in_torch(device, block, monkeypatch):
    """decode_backend='triton' runs GPT-OSS's sink layers (the sliding layer's ring, the
    full layer's cache) through the kernel: the torch path's greedy tokens, past the window."""
    from hybridflow.engine import Engine, EngineOptions, SamplingParams
    from hybridflow.engine.kernels import attention
    from tests.engine.gpt_oss_helpers import gpt_oss_model

    calls = []
    kernel = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention",
                        lambda *a, **k: calls.append(k["sinks"]) or kernel(*a, **k))  # fmt: skip

    model = gpt_oss_model().to(device)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 9, 33, 2, 71] * 2, [40, 41, 7]]
    got = {}
    for backend in ("torch", "triton"):
        options = EngineOptions(decode_backend=backend, cuda_graphs=False, kv_block_size=block,
                                steps_per_sync=4)  # fmt: skip
        engine = Engine(model, 4, 32, options=options)
        assert engine.native
        got[backend] = engine.generate(prompts, params)
    assert len(calls) >= 2 * 7 and all(sinks is not None for sinks in calls)  # both layers
    assert [c.token_ids for c in got["triton"]] == [c.token_ids for c in got["torch"]]
    for a, b in zip(got["triton"], got["torch"]):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
