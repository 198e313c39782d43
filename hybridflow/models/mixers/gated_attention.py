"""Gated attention (Qwen3.5, Qwen3-Next): GQA whose q projection also yields an output gate.

q_proj gives, per head, the query and a gate of head_dim each ([q_h | gate_h] rows); q and k
are normalised per head by a zero-centred RMSNorm, RoPE turns the first
partial_rotary_factor of each head's dimensions, and the attention output is multiplied by
sigmoid(gate) before o_proj. The K/V it keeps are plain GQA K/V."""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.models.attention import Attend
from hybridflow.models.norm import ZeroCenteredRMSNorm
from hybridflow.models.rope import apply_rope


class GatedAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_dim = config.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, 2 * q_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H] -> q [..., nh, hd], k/v [..., nkv, hd] (normed, RoPE applied) and the
        output gate [..., nh, hd] (before its sigmoid)."""
        q, gate = self.q_proj(x).unflatten(-1, (-1, 2 * self.head_dim)).chunk(2, dim=-1)
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        q, k, v, gate = self.project_qkv(x, cos, sin)
        out = attend(q, k, v) * torch.sigmoid(gate)
        return self.o_proj(out.flatten(-2))
