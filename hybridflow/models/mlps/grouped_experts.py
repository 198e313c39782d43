"""DeepSeek's MoE layer: grouped routing, plus shared experts.

    scores = sigmoid(gate(x)) in fp32;  choice = scores + e_score_correction_bias
    the experts split into n_group groups; a group's score is the sum of its two best
    choices; the topk_group best groups stay, and the top-k choices among their experts win
    weights = scores at the winners (renormalised iff norm_topk_prob) * routed_scaling_factor
    out = experts(x, winners, weights) + shared_experts(x)

The correction bias steers which experts win (DeepSeek's auxiliary-loss-free balancing) but
never weighs an output. DeepSeek-V2 (topk_method "greedy" / "group_limited_greedy") scores by
softmax, has no correction, ranks a group by its best expert and never renormalises; its
weights are scaled the same. HF's names: mlp.gate.weight [E, H], mlp.gate.e_score_correction_bias
[E] (a buffer), mlp.experts (models/moe.Experts), mlp.shared_experts.{gate,up,down}_proj.
Routing replay keeps recorded winners and recomputes their weights from the current scores,
so the router still learns; the shared experts route nothing and record nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.mlps.dense import MLP
from hybridflow.models.moe import SparseMoeBlock


def grouped_topk(
    scores: torch.Tensor, correction: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> torch.Tensor:
    """scores [T, E] fp32 (sigmoid), correction [E] -> expert ids [T, k]: the k best of
    scores + correction among the experts of the topk_group best groups (a group scores the
    sum of its two best)."""
    choice = scores + correction.to(scores.dtype)
    tokens, experts = choice.shape
    if n_group > 1:
        groups = choice.view(tokens, n_group, experts // n_group)
        group_scores = groups.topk(min(2, experts // n_group), dim=-1).values.sum(-1)  # [T, G]
        best = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(groups).reshape(tokens, experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    return choice.topk(top_k, dim=-1).indices


def softmax_grouped_topk(
    scores: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> torch.Tensor:
    """DeepSeek-V2's group_limited_greedy: scores [T, E] (softmax) -> ids [T, k], the k best
    among the experts of the topk_group groups whose best expert scores highest."""
    tokens, experts = scores.shape
    groups = scores.view(tokens, n_group, experts // n_group)
    best = groups.max(dim=-1).values.topk(topk_group, dim=-1).indices
    keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=scores.device)
    keep = keep.scatter_(1, best, True).unsqueeze(-1).expand_as(groups).reshape(tokens, experts)
    return scores.masked_fill(~keep, 0.0).topk(top_k, dim=-1).indices


def grouped_weights(
    scores: torch.Tensor, topk_ids: torch.Tensor, norm_topk_prob: bool, scaling: float
) -> torch.Tensor:
    """Weights [T, k] fp32 of the experts ``topk_ids`` under sigmoid ``scores`` [T, E]:
    differentiable in the scores, so a replayed route still trains the router."""
    weights = scores.gather(-1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling


class GroupedRouter(nn.Module):
    """HF's ``mlp.gate``: the router weight and its score-correction buffer."""

    def __init__(self, num_experts: int, hidden_size: int, correction: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if correction:  # V3's; V2 routes without one
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))


class GroupedExpertsMoeBlock(SparseMoeBlock):
    def __init__(self, config):
        super().__init__(config)
        self.topk_method = config.topk_method
        self.gate = GroupedRouter(config.num_experts, config.hidden_size,
                                  correction=self.topk_method == "noaux_tc")  # fmt: skip
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config, shared) if shared else None

    def route(
        self, flat: torch.Tensor, recorded_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # in fp32 whatever the compute dtype, as DeepSeek (and HF) route
        router_logits = F.linear(flat.float(), self.gate.weight.float())  # [T, E]
        if self.topk_method == "noaux_tc":
            scores = router_logits.sigmoid()
            correction = self.gate.e_score_correction_bias
            topk_ids = grouped_topk(scores, correction, self.top_k, self.n_group, self.topk_group)
        else:
            scores = router_logits.softmax(dim=-1)
            groups = self.n_group if self.topk_method == "group_limited_greedy" else 1
            chosen = self.topk_group if groups > 1 else 1
            topk_ids = softmax_grouped_topk(scores, self.top_k, groups, chosen)
        if recorded_ids is not None:
            recorded = (recorded_ids >= 0).all(dim=-1, keepdim=True)
            topk_ids = torch.where(recorded, recorded_ids.to(topk_ids.dtype), topk_ids)
        weights = grouped_weights(scores, topk_ids, self.norm_topk_prob, self.routed_scaling_factor)
        return router_logits, topk_ids, weights

    def forward_routed(
        self, x: torch.Tensor, recorded_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        routed, router_logits, topk_ids = super().forward_routed(x, recorded_ids)
        if self.shared_experts is None:
            return routed, router_logits, topk_ids
        return routed + self.shared_experts(x).to(routed.dtype), router_logits, topk_ids
