"""GQA with attention sinks, over the whole prefix or a sliding window (GPT-OSS).

Each head has a learned sink logit: it joins the softmax over the keys as one more column
and is dropped after, so a head can put weight on "nothing" (its output shrinks toward 0)
instead of on some token. A sliding-window layer lets query i see keys i-window+1 .. i;
GPT-OSS alternates sliding and full layers as config.json's layer_types says. q/k/v/o carry
biases; RoPE as in Llama (GPT-OSS uses YaRN). Parameter names are HF's (``sinks`` [nh]).

The math here is the plain torch reference (the CPU path and the test oracle), one
sequence's [heads, T, T] scores at a time; the K/V it leaves are plain GQA K/V, a window's
worth on the sliding layers.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.models.attention import Attend
from hybridflow.models.rope import apply_rope


def sink_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, T, nh, hd], k/v [B, T, nkv, hd], sinks [nh], key_mask [B, T] (1 = token; None:
    no padding) -> [B, T, nh, hd]. Query i sees keys j <= i (and i - j < window when window
    > 0) that are tokens, plus its head's sink."""
    groups = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, nh, T, hd]
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [B, nh, T, T]
    length = q.shape[2]
    rows = torch.arange(length, device=q.device)
    distance = rows[:, None] - rows[None, :]  # query - key
    allowed = distance >= 0
    if window:
        allowed = allowed & (distance < window)
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return (probs.to(v.dtype) @ v).transpose(1, 2)


def sink_attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """Packed tokens q [N, nh, hd], k/v [N, nkv, hd], sequence i at rows cu_seqlens[i]:
    cu_seqlens[i+1] -> [N, nh, hd]; no sequence sees another's keys."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    pieces = [
        sink_attention_rows(q_i[None], k_i[None], v_i[None], sinks, window)[0]
        for q_i, k_i, v_i in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ]
    rest = q.shape[0] - sum(lengths)  # rows past the last sequence (none in practice)
    if rest:
        pieces.append(q.new_zeros(rest, *q.shape[1:]))
    return torch.cat(pieces)


class SinkAttention(nn.Module):
    def __init__(self, config, window: int = 0):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.window = window
        hidden, q_dim = config.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.o_proj_bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, layout
    ) -> torch.Tensor:
        """layout: the forward's TokenLayout (packed: cu_seqlens; padded: attention_mask).
        ``attend`` (sink-less kernels) is not used."""
        q, k, v = self.project_qkv(x, cos, sin)
        if layout.is_packed:
            out = sink_attention_packed(q, k, v, self.sinks, self.window, layout.cu_seqlens)
        else:
            out = sink_attention_rows(q, k, v, self.sinks, self.window, layout.attention_mask)
        return self.o_proj(out.flatten(-2))
