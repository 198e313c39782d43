"""GQA attention with RoPE: the token mixer of the Llama family and its MoE relatives.

Optional q/k/v bias (Qwen2), o_proj bias (Llama with attention_bias) and per-head q/k
RMSNorm (Qwen3). The attention kernel itself is passed in (models/attention.py), so the
padded, packed and sequence-parallel forwards share this module."""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.models.attention import Attend
from hybridflow.models.norm import RMSNorm
from hybridflow.models.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_dim = config.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H] -> q [..., nh, hd], k/v [..., nkv, hd], with qk-norm and RoPE applied.

        Exposed separately so the generation engine can write k/v into its cache."""
        # -1 heads: under tensor parallelism the projections hold this rank's heads only
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        return self.o_proj(attend(q, k, v).flatten(-2))
