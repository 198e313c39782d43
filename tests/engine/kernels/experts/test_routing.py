"""The routing kernel (kernels/experts/routing.py) against torch's softmax and top-k, its routing
record included. CUDA (marked gpu) or the CPU under TRITON_INTERPRET=1, at tiny sizes."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine.kernels.experts import routing  # noqa: E402


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
    record = routing.RouteRecord(routes, entries, offsets, column=top_k)  # the second sparse layer
    ids, weights = routing.route_topk(logits, top_k, renormalize, record)
    expected_ids, expected_weights = _reference_routing(logits, top_k, renormalize)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    recorded = routes[entries, offsets, 1]
    assert torch.equal(recorded.long(), expected_ids)
    assert (routes[entries, offsets, 0] == 255).all()  # the other layer's column untouched
