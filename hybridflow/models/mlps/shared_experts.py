"""Routed experts plus a shared expert behind a sigmoid gate (Qwen3.5-MoE, Qwen3-Next).

    out = experts(x, top-k of softmax(gate(x))) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

The routed part is models/moe.SparseMoeBlock (its routing recorded and replayed the same
way); HF's names: mlp.gate, mlp.experts, mlp.shared_expert.{gate,up,down}_proj,
mlp.shared_expert_gate."""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.models.mlps.dense import MLP
from hybridflow.models.moe import SparseMoeBlock


class SharedExpertMoeBlock(SparseMoeBlock):
    def __init__(self, config):
        super().__init__(config)
        self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward_routed(
        self, x: torch.Tensor, recorded_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        routed, router_logits, topk_ids = super().forward_routed(x, recorded_ids)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared.to(routed.dtype), router_logits, topk_ids
