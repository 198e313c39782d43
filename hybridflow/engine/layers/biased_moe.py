"""GPT-OSS's mixture-of-experts MLP in the engine's eager passes: a router with a bias,
experts with biases and the clamped SwiGLU (models/mlps/biased_experts.py), each token's
expert ids recorded at its cache position for routing replay, as layers/moe.experts_torch
does for the plain experts."""

from __future__ import annotations

import torch

from hybridflow.models.mlps.biased_experts import topk_softmax_route


def biased_experts_torch(mlp, x: torch.Tensor, target, sparse_index: int,
                         keep: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [N, H] (post-attention normed) -> [N, H] (or [len(keep), H]): the block's own
    routing and experts; target: layers/moe.RouteTarget (None: no record); keep: every token
    is routed and recorded, the experts run for these rows only."""
    ids, weights = topk_softmax_route(mlp.router_logits(x), mlp.top_k)
    if target is not None:
        target.routes[target.entries, target.offsets, sparse_index] = ids.to(target.routes.dtype)
    if keep is not None:
        x, ids, weights = x[keep], ids[keep], weights[keep]
    return mlp.experts_output(x, ids, weights)
