"""The mixture-of-experts kernels (kernels/moe.py) against literal torch loops: routing, the
sort by expert, the grouped expert matmuls and the combine. CUDA (marked gpu) or the CPU
under TRITON_INTERPRET=1, at tiny sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine.kernels import moe  # noqa: E402


def _reference_routing(logits, top_k, renormalize):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk_matches_softmax_topk_and_records(renormalize):
    tokens, experts, top_k = 19, 12, 3  # a partial row block, experts not a power of two
    logits = torch.randn(tokens, experts, device=DEVICE)
    routes = torch.full((4, 8, 2, top_k), 255, dtype=torch.uint8, device=DEVICE)
    entries = torch.arange(tokens, device=DEVICE) // 8 % 4  # distinct (entry, offset) pairs
    offsets = torch.arange(tokens, device=DEVICE) % 8
    record = moe.RouteRecord(routes, entries, offsets, column=top_k)  # the second sparse layer
    ids, weights = moe.route_topk(logits, top_k, renormalize, record)
    expected_ids, expected_weights = _reference_routing(logits, top_k, renormalize)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    recorded = routes[entries, offsets, 1]
    assert torch.equal(recorded.long(), expected_ids)
    assert (routes[entries, offsets, 0] == 255).all()  # the other layer's column untouched


def test_align_pairs_sorts_by_expert_in_pair_order_and_pads_runs():
    tokens, top_k, experts, block_m = 9, 2, 5, 16
    ids = torch.tensor([[0, 3], [3, 1], [4, 0], [0, 3], [1, 4], [3, 0], [0, 1], [3, 4], [0, 3]],
                       dtype=torch.int32, device=DEVICE)  # expert 2 untouched  # fmt: skip
    blocks = moe.align_pairs(ids, experts, block_m)
    flat = ids.flatten().tolist()
    total = int(blocks.total)
    sorted_pairs = blocks.sorted_pairs[:total].tolist()
    block_expert = blocks.block_expert[: total // block_m].tolist()
    expected, expected_blocks, expected_ends = [], [], []
    for expert in range(experts):
        run = [p for p, e in enumerate(flat) if e == expert]  # pair order inside a run
        padded = -(-len(run) // block_m) * block_m
        expected += run + [tokens * top_k] * (padded - len(run))
        expected_blocks += [expert] * (padded // block_m)
        expected_ends.append(len(expected))
    assert sorted_pairs == expected
    assert block_expert == expected_blocks
    assert blocks.group_ends.tolist() == expected_ends
    assert blocks.max_blocks * block_m >= total


def _reference_experts(x, ids, weights, gate_up, down):
    """The literal loop: each token's k experts, weighted and summed."""
    inner = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e] @ x[t]
            out[t] += weights[t, j] * (down[e] @ (F.silu(h[:inner]) * h[inner:]))
    return out


@pytest.mark.parametrize("tokens,block_m", [(7, 16), (40, 32)])
def test_grouped_expert_matmuls_and_combine_match_the_loop(tokens, block_m):
    """fp32; one expert gets more than a block (40 tokens x 3 over 6 experts), one none."""
    experts, top_k, hidden, inner = 6, 3, 48, 40  # inner not a multiple of the tile
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=generator) * 0.2).to(DEVICE)
    down = (torch.randn(experts, hidden, inner, generator=generator) * 0.2).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=generator).to(DEVICE)
    logits[:, 5] = -30.0  # expert 5 never chosen
    ids, weights = moe.route_topk(logits, top_k, renormalize=True)
    blocks = moe.align_pairs(ids, experts, block_m)
    act = moe.grouped_gate_up(x, gate_up, blocks)
    pair_out = moe.grouped_down(act, down, blocks)
    out = moe.combine(pair_out, weights)
    expected = _reference_experts(x, ids, weights, gate_up, down)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_block_rows_grows_with_the_pairs_per_expert():
    # Qwen3-30B-A3B (128 experts, top-8): 256 decode rows average 16 pairs an expert
    assert moe.block_rows(256, 8, 128) == 32
    assert moe.block_rows(16, 8, 128) == 16
    assert moe.block_rows(1024, 8, 128) == 64
    assert moe.block_rows(16384, 8, 128) == 128
