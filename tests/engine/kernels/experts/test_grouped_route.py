"""kernels/experts/grouped_route.py: DeepSeek-V3's grouped sigmoid routing in one launch against the
model's (grouped_experts.grouped_topk and grouped_weights): the same winners in the same
order, the same weights, the ids written to the routing record, for one group (Moonlight),
groups of two and of several experts (DeepSeek-V3's 8 of 32). Runs on CUDA, or on CPU under
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine.kernels.experts.grouped_route import grouped_route  # noqa: E402
from hybridflow.engine.kernels.experts.routing import RouteRecord  # noqa: E402
from hybridflow.models.mlps.grouped_experts import grouped_topk, grouped_weights  # noqa: E402


@pytest.mark.parametrize(("experts", "top_k", "n_group", "topk_group"),
                         [(64, 6, 1, 1), (8, 2, 4, 2), (256, 8, 8, 4)])  # fmt: skip
@pytest.mark.parametrize("renormalize", [True, False])
def test_one_launch_routes_as_the_model(experts, top_k, n_group, topk_group, renormalize):
    tokens = 37
    generator = torch.Generator().manual_seed(experts + top_k)
    logits = (torch.randn(tokens, experts, generator=generator) * 2).to(DEVICE)
    correction = (torch.randn(experts, generator=generator) * 0.1).to(DEVICE)
    scores = logits.sigmoid()
    want_ids = grouped_topk(scores, correction, top_k, n_group, topk_group)
    want_weights = grouped_weights(scores, want_ids, renormalize, 2.5)
    routes = torch.full((6, 9, 3, top_k), 255, dtype=torch.uint8, device=DEVICE)
    locations = torch.randperm(6 * 9, generator=generator)[:tokens].to(DEVICE)  # distinct
    entries, offsets = locations // 9, locations % 9
    record = RouteRecord(routes, entries, offsets, column=1 * top_k)
    ids, weights = grouped_route(logits, correction, top_k, n_group, topk_group, renormalize,
                                 2.5, record)  # fmt: skip
    assert (ids.long() == want_ids).all()
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-6)
    want_routes = torch.full_like(routes, 255)
    want_routes[entries, offsets, 1] = want_ids.to(torch.uint8)
    assert (routes == want_routes).all()
