"""The torch._grouped_mm path of a sparse layer (engine/layers/moe._pairs_grouped_mm, the
prefill passes on Hopper) against the per-expert loop: all experts and a rank's share. The
sort by expert and SiLU*up are Triton kernels: CUDA (marked gpu) or the CPU under
TRITON_INTERPRET=1; torch._grouped_mm runs on both."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.layers.moe import _pairs_grouped_mm
from hybridflow.engine.layers.pair_order import rows_in_pair_order
from hybridflow.models.moe import moe_experts


def test_rows_come_back_in_pair_order_and_pairs_held_elsewhere_are_zero():
    """Sorted rows (a row's value: 10 * its pair + 1; padding rows hold -1) and each row's
    pair, P = 5 marking padding; pair 2 is in no row (its expert is held elsewhere)."""
    pair_index = torch.tensor([3, 0, 5, 4, 1, 5, 5, 5])
    rows = torch.where(pair_index < 5, 10.0 * pair_index + 1, -1.0)[:, None].repeat(1, 4)
    out = rows_in_pair_order(rows, pair_index, 5, subset=True)
    assert out[:, 0].tolist() == [1.0, 11.0, 0.0, 31.0, 41.0]
    assert (out == out[:, :1]).all()  # whole rows moved
    every = torch.tensor([3, 0, 2, 4, 1, 5, 5, 5])
    rows = torch.where(every < 5, 10.0 * every + 1, -1.0)[:, None].repeat(1, 4)
    out = rows_in_pair_order(rows, every, 5, subset=False)
    assert out[:, 0].tolist() == [1.0, 11.0, 21.0, 31.0, 41.0]


GPU = [pytest.mark.gpu] if torch.cuda.is_available() else []


@pytest.mark.parametrize("first", [pytest.param(f, marks=GPU) for f in (None, 0, 2)])
def test_grouped_mm_path_matches_the_loop(first):
    """13 tokens x top-3 of 6 experts (P = 39: not a multiple of the block), expert 5 never
    chosen; first: the weights hold experts [first, first + 3) only. fp32 on the CPU, bf16
    on a Hopper GPU (torch._grouped_mm's dtypes there) against the fp32 loop."""
    from triton_device import triton_test_device

    device = triton_test_device()  # skips without CUDA or TRITON_INTERPRET=1
    if device == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch._grouped_mm runs on Hopper")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokens, experts, top_k, hidden, inner = 13, 6, 3, 32, 24  # 16-byte rows (grouped mm)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=generator) * 0.2
    down = torch.randn(experts, hidden, inner, generator=generator) * 0.2
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, 5] = -30.0
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    held = slice(None) if first is None else slice(first, first + 3)
    x, gate_up, down = (t.to(device=device, dtype=dtype) for t in (x, gate_up, down))
    ids32 = ids.to(device=device, dtype=torch.int32)
    pair_out = _pairs_grouped_mm(x, ids32, gate_up[held], down[held], first).float().cpu()
    out = (pair_out.view(tokens, top_k, hidden) * weights[..., None]).sum(1)
    expected = moe_experts(x.float().cpu(), ids, weights, gate_up[held].float().cpu(),
                           down[held].float().cpu(), "loop", first_expert=first)  # fmt: skip
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # each projection rounded to bf16
        assert ((out - expected).norm() / expected.norm()).item() < 2e-2
