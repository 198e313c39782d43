"""GPT-OSS's MoE layer: a router with a bias, experts with biases, a clamped SwiGLU.

    logits = router(x) (+ bias);  the top-k logits win, weighted by their softmax
    gate_up = x @ W_gu[e] + b_gu[e]   gate = columns 0, 2, 4, ...; up = columns 1, 3, 5, ...
    act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = clamp(gate, max=limit)
    out = act @ W_d[e] + b_d[e]

HF's names and layout, kept in memory as on disk: mlp.router.{weight [E, H], bias [E]},
mlp.experts.gate_up_proj [E, H, 2I] (gate and up interleaved), gate_up_proj_bias [E, 2I],
down_proj [E, I, H], down_proj_bias [E, H]. The experts run through models/moe.moe_experts
(grouped GEMMs on CUDA) on transposed views. Routing replay keeps recorded ids and
recomputes their weights from the current logits.

Expert parallelism (models/sharding/expert_parallel.py) splits every tensor of ``experts``
(the biases with their experts) on the expert axis; the router and its bias stay whole.
LoRA adapts each expert's two projections (models/moe.ExpertLoRA, in this layout).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.moe import (
    NO_ROUTE,
    ExpertLoRA,
    ExpertSlice,
    active_adapters,
    local_part,
    moe_experts,
)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[M, 2I] interleaved (gate, up) columns -> [M, I]."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def topk_softmax_route(
    router_logits: torch.Tensor, top_k: int, recorded_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k], weights [T, k] fp32: softmax over the chosen logits); recorded ids
    replace the choice where a token has them (NO_ROUTE rows route freely)."""
    topk_ids = router_logits.topk(top_k, dim=-1).indices
    if recorded_ids is not None:
        recorded = (recorded_ids > NO_ROUTE).all(dim=-1, keepdim=True)
        topk_ids = torch.where(recorded, recorded_ids.to(topk_ids.dtype), topk_ids)
    return topk_ids, torch.softmax(router_logits.float().gather(-1, topk_ids), dim=-1)


class BiasedRouter(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts))


class BiasedExperts(nn.Module):
    """HF's ``mlp.experts`` of GPT-OSS: stored [E, in, out] (``stored_in_out``), each
    projection with a bias. ``forward`` runs the routed tokens through them, so that FSDP2
    wrapping this module (learners/sharding/expert_shard.py) sees its parameters used inside
    its own call."""

    stored_in_out = True
    expert_tensors = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

    def __init__(self, num_experts: int, hidden_size: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * inner))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * inner))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inner, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.lora: ExpertLoRA | None = None  # set by learners/lora.py

    def forward(
        self,
        flat: torch.Tensor,
        topk_ids: torch.Tensor,
        weights: torch.Tensor,
        activation,
        backend: str = "auto",
        group=None,
        dispatch=None,
    ) -> torch.Tensor:
        """flat [T, H] in the compute dtype, each token's experts [T, k] and weights [T, k]
        -> [T, H]. group: the expert-parallel group (these tensors hold its rank's E/EP
        experts), run by ``dispatch`` (models/sharding/expert_parallel.expert_parallel_moe)."""
        dtype = flat.dtype
        # [E, H, 2I] / [E, I, H] as stored -> the [E, out, in] views moe_experts multiplies by
        gate_up = local_part(self.gate_up_proj).to(dtype).transpose(1, 2)
        down = local_part(self.down_proj).to(dtype).transpose(1, 2)
        biases = (local_part(self.gate_up_proj_bias), local_part(self.down_proj_bias))
        adapters = active_adapters(self.lora)
        if group is not None:
            return dispatch(flat, topk_ids, weights, gate_up, down, group, backend, adapters,
                            activation=activation, biases=biases)  # fmt: skip
        return moe_experts(flat, topk_ids, weights, gate_up, down, backend, adapters,
                           activation=activation, biases=biases)  # fmt: skip


class BiasedExpertsMoeBlock(nn.Module):
    """forward(x) -> out; forward_routed(x, recorded_ids) -> (out, router_logits, topk_ids),
    as models/moe.SparseMoeBlock.

    Attributes:
        expert_backend: models/moe.EXPERT_BACKENDS ("auto": grouped GEMMs on CUDA).
        expert_group: expert parallelism (models/sharding/expert_parallel.py): the experts hold
            this rank's E/EP experts and tokens are dispatched over the group; None: all.
        expert_slice: the tensor-parallel rollout's split (engine/tensor_parallel.py): the
            experts (and their biases) hold this rank's share, every token is routed here and
            the partial outputs are summed over the group; None: all experts."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.router = BiasedRouter(config.num_experts, config.hidden_size)
        self.experts = BiasedExperts(config.num_experts, config.hidden_size,
                                     config.moe_intermediate_size)  # fmt: skip
        self.swiglu_alpha, self.swiglu_limit = config.swiglu_alpha, config.swiglu_limit
        self.activation = partial(clamped_swiglu, alpha=config.swiglu_alpha,
                                  limit=config.swiglu_limit)  # fmt: skip
        self.expert_backend = "auto"
        self.expert_group = None
        self.expert_dispatch = None  # how the experts run over expert_group (set beside it)
        self.expert_slice: ExpertSlice | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_routed(x)[0]

    def forward_routed(
        self, x: torch.Tensor, recorded_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            flat = flat.to(torch.get_autocast_dtype(device_type))
        router_logits = self.router_logits(flat)
        topk_ids, weights = topk_softmax_route(router_logits, self.top_k, recorded_ids)
        out = self.experts_output(flat, topk_ids, weights)
        return out.view(*x.shape[:-1], -1), router_logits, topk_ids

    def router_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """flat [T, H] -> [T, E], in flat's dtype (the engine routes through this too)."""
        dtype = flat.dtype
        return F.linear(flat, self.router.weight.to(dtype), self.router.bias.to(dtype))

    def experts_output(
        self, flat: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """flat [T, H], each token's experts [T, k] and weights [T, k] -> [T, H]."""
        if self.expert_slice is not None:
            return self._sliced_output(flat, topk_ids, weights)
        return self.experts(flat, topk_ids, weights, self.activation, self.expert_backend,
                            self.expert_group, self.expert_dispatch)  # fmt: skip

    def _sliced_output(
        self, flat: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts' share of the output (a pair routed elsewhere adds zero, its
        bias too), summed over the slice's group: every rank calls it with the same tokens."""
        import torch.distributed as dist

        experts, dtype = self.experts, flat.dtype
        out = moe_experts(flat, topk_ids, weights, experts.gate_up_proj.to(dtype).transpose(1, 2),
                          experts.down_proj.to(dtype).transpose(1, 2), self.expert_backend,
                          activation=self.activation, first_expert=self.expert_slice.first,
                          biases=(experts.gate_up_proj_bias, experts.down_proj_bias))  # fmt: skip
        dist.all_reduce(out, group=self.expert_slice.group)
        return out
