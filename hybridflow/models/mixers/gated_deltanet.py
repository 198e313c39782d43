"""Gated DeltaNet (Qwen3.5's linear-attention layers): a token mixer with a recurrent state.

    qkv = silu(causal depthwise conv(in_proj_qkv(x)))     split into q, k (key heads), v
    beta = sigmoid(in_proj_b(x));  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    o = gated delta rule(q, k, v, g, beta)                 models/mixers/gated_delta_rule.py
    out = out_proj(RMSNorm(o) * silu(in_proj_z(x)))        per value head

What a sequence carries from token to token is the conv's last kernel-1 inputs and the
[Hv, Dk, Dv] state; nothing grows with its length. Parameter names are HF's (Qwen3.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.mixers.gated_delta_rule import (
    chunked_gated_delta_rule,
    packed_gated_delta_rule,
    recurrent_gated_delta_rule,
    rows_of_packed,
)
from hybridflow.models.mixers.token_layout import HeadWeights, TokenLayout
from hybridflow.models.norm import GatedRMSNorm
from hybridflow.models.sharding.deltanet_parallel import ulysses_mix


def causal_conv_packed(
    x: torch.Tensor, weight: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """Depthwise causal conv along each packed sequence: x [N, C], weight [C, 1, K],
    columns [N] -> [N, C]; token t sums weight[:, 0, K-1-j] * x[t-j] over j <= its column,
    so no sequence reads its neighbour's tokens."""
    kernel = weight.shape[-1]
    taps = weight[:, 0, :].to(x.dtype)  # [C, K]
    out = x * taps[:, kernel - 1]
    for shift in range(1, kernel):
        previous = F.pad(x, (0, 0, shift, 0))[: x.shape[0]]
        inside = (columns >= shift).to(x.dtype)[:, None]
        out = out + previous * inside * taps[:, kernel - 1 - shift]
    return out


def causal_conv_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv along rows: x [B, T, C], weight [C, 1, K] -> [B, T, C]."""
    kernel = weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.to(x.dtype), padding=kernel - 1, groups=x.shape[-1])
    return out[..., : x.shape[1]].transpose(1, 2)


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [..., Hv] fp32 log decay, beta [..., Hv]) of in_proj_a's and in_proj_b's outputs
    a, b [..., Hv] and the per-head A_log, dt_bias [Hv] (any subset of heads, in order)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b)


@dataclass
class RecurrentState:
    """What S sequences carry through one Gated DeltaNet layer: ``conv`` [S, C, K-1], the
    conv's last K-1 inputs (oldest first, the layer's dtype), and ``ssm`` [S, Hv, Dk, Dv],
    the delta-rule state in fp32."""

    conv: torch.Tensor
    ssm: torch.Tensor


class GatedDeltaNet(nn.Module):
    """Attributes:
    delta_backend: mixers/gated_delta_rule.DELTA_BACKENDS for the packed forward ("auto":
        fla-core's kernel on CUDA when installed, else the chunked torch reference)."""

    def __init__(self, config):
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        hidden, conv_dim = config.hidden_size, 2 * self.key_dim + self.value_dim
        kernel = config.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False,
                                padding=kernel - 1)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.delta_backend = "auto"
        # tensor parallelism: this rank's heads (models/sharding/tensor_parallel.TensorHeads)
        self.tensor_heads = None

    @torch.no_grad()
    def init_state_parameters(self, generator: torch.Generator) -> None:
        """HF's init of the decay: dt_bias = 1, A = U(0.01, 16) stored as its log."""
        self.dt_bias.fill_(1.0)
        a = torch.rand(self.num_v_heads, generator=generator, device=self.A_log.device)
        self.A_log.copy_(torch.log(0.01 + a * (16 - 0.01)))

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [..., Hv] fp32 log decay, beta [..., Hv]) of the layer input x [..., H]."""
        return decay_and_beta(self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias)

    def head_weights(self) -> HeadWeights:
        """The conv taps, A_log and dt_bias of this rank's heads (all of them but under
        tensor parallelism)."""
        if self.tensor_heads is not None:
            return HeadWeights(*self.tensor_heads.local(self.conv1d.weight, self.A_log,
                                                        self.dt_bias))  # fmt: skip
        return HeadWeights(conv=self.conv1d.weight, A_log=self.A_log, dt_bias=self.dt_bias)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """in_proj_qkv's output [..., C] (of this rank's heads under tensor parallelism)."""
        if self.tensor_heads is not None:
            return self.tensor_heads.project_qkv(x, self.in_proj_qkv.weight)
        return self.in_proj_qkv(x)

    def forward(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """The training op: x [N, H] packed or [B, T, H] padded (``layout``) -> [..., H]."""
        return self._run(x, layout)[0]

    def prefill(self, x: torch.Tensor, layout: TokenLayout) -> tuple[torch.Tensor, RecurrentState]:
        """The engine's prefill: packed prompts x [N, H] -> (out [N, H], each sequence's state
        after its last token, for :meth:`decode` to continue from)."""
        if not layout.is_packed:
            raise ValueError("prefill takes packed sequences (TokenLayout.packed)")
        out, mixed, ssm = self._run(x, layout, final_state=True)
        kept = self.conv1d.weight.shape[-1] - 1
        ends = layout.cu_seqlens[1:].long()
        lengths = ends - layout.cu_seqlens[:-1].long()
        offsets = torch.arange(kept, device=x.device)
        index = (ends[:, None] - kept + offsets).clamp(min=0)  # [S, K-1]: the last inputs
        inside = (offsets >= kept - lengths[:, None]).to(mixed.dtype)  # shorter: zeros first
        conv = (mixed[index] * inside[..., None]).transpose(1, 2).contiguous()  # [S, C, K-1]
        return out, RecurrentState(conv=conv, ssm=ssm)

    def extend(self, x: torch.Tensor, layout: TokenLayout, state: RecurrentState) -> torch.Tensor:
        """The engine's extend pass: packed new tokens x [N, H] of S sequences that continue
        from ``state`` (theirs, in order: a kept turn, an earlier chunk of a prompt) -> out
        [N, H]; the state moves on past each sequence's last token, in place."""
        if not layout.is_packed:
            raise ValueError("extend takes packed sequences (TokenLayout.packed)")
        mixed = self.in_proj_qkv(x)  # [N, C]
        kept = self.conv1d.weight.shape[-1] - 1
        rows, columns = rows_of_packed(layout.cu_seqlens, layout.max_seqlen)
        count = len(layout.cu_seqlens) - 1
        # each sequence as a row: its kept conv inputs, then its new inputs (right-padded)
        grid = mixed.new_zeros(count, kept + layout.max_seqlen, mixed.shape[-1])
        grid[:, :kept] = state.conv.transpose(1, 2).to(mixed.dtype)
        grid[rows, columns + kept] = mixed
        convolved = F.conv1d(grid.transpose(1, 2), self.conv1d.weight.to(mixed.dtype),
                             groups=mixed.shape[-1])  # fmt: skip  # [S, C, T]
        convolved = convolved.transpose(1, 2)[rows, columns]
        lengths = (layout.cu_seqlens[1:] - layout.cu_seqlens[:-1]).long()
        last = lengths[:, None] + torch.arange(kept, device=x.device)  # the last K-1 inputs
        conv = grid[torch.arange(count, device=x.device)[:, None], last]  # [S, K-1, C]
        q, k, v = self._heads(F.silu(convolved))
        g, beta = self.gates(x)
        core, ssm = packed_gated_delta_rule(q, k, v, g, beta, layout.cu_seqlens, layout.max_seqlen,
                                            self.delta_backend, True, state.ssm)  # fmt: skip
        state.conv.copy_(conv.transpose(1, 2))
        state.ssm.copy_(ssm)
        return self.output(core, x)

    def decode(self, x: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """The engine's decode step: one token of each of B sequences, x [B, H] -> [B, H];
        ``state`` (theirs, in order) moves one token on, in place."""
        mixed = self.in_proj_qkv(x)  # [B, C]
        window = torch.cat([state.conv.to(mixed.dtype), mixed[..., None]], dim=-1)  # [B, C, K]
        state.conv.copy_(window[..., 1:])
        convolved = (window * self.conv1d.weight[:, 0, :].to(window.dtype)).sum(-1)
        q, k, v = self._heads(F.silu(convolved))
        g, beta = self.gates(x)
        core, ssm = recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state.ssm
        )
        state.ssm.copy_(ssm)
        return self.output(core[:, 0].to(v.dtype), x)

    def _heads(self, mixed: torch.Tensor):
        """The conv's output [..., C'] of all heads or of a rank's (q, k and v channels in
        the layer's proportions) -> q, k [..., Hk', Dk], v [..., Hv', Dv]."""
        key = mixed.shape[-1] * self.key_dim // (2 * self.key_dim + self.value_dim)
        q, k, v = mixed.split([key, key, mixed.shape[-1] - 2 * key], dim=-1)
        return (q.unflatten(-1, (-1, self.head_k_dim)), k.unflatten(-1, (-1, self.head_k_dim)),
                v.unflatten(-1, (-1, self.head_v_dim)))  # fmt: skip

    def output(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The delta rule's output core [..., Hv, Dv] (x's dtype) -> the layer's [..., H]:
        RMSNorm gated by silu(in_proj_z(x)), then out_proj."""
        z = self.in_proj_z(x).unflatten(-1, (-1, self.head_v_dim))
        return self.out_proj(self.norm(core, z).flatten(-2))

    def _run(self, x: torch.Tensor, layout: TokenLayout, final_state: bool = False):
        """-> (out, the conv's inputs, the last states [S, Hv, Dk, Dv] or None)."""
        if layout.attention_mask is not None:  # padding tokens enter as zeros: no state change
            x = x * layout.attention_mask[..., None].to(x.dtype)
        mixed, a, b = self.project_qkv(x), self.in_proj_a(x), self.in_proj_b(x)
        if layout.sequence_group is not None:
            if final_state:
                raise ValueError("a sequence-parallel forward keeps no final state")
            core = ulysses_mix(self, mixed, a, b, layout, self.head_weights())
            return self.output(core, x), mixed, None
        core, ssm = self.mix(mixed, a, b, layout, self.head_weights(), final_state)
        return self.output(core, x), mixed, ssm

    def mix(
        self,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        layout: TokenLayout,
        weights: HeadWeights,
        final_state: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-head part of the layer, for all its heads or some (a parallel rank's):
        in_proj_qkv's output ``mixed`` [..., C'] (their q, k, v channels), in_proj_a's and
        in_proj_b's ``a``, ``b`` [..., Hv'] and their ``weights`` -> (the delta rule's output
        [..., Hv', Dv] in mixed's dtype, the last states [S, Hv', Dk, Dv] or None)."""
        if layout.is_packed:
            convolved = causal_conv_packed(mixed, weights.conv, layout.columns)
        else:
            convolved = causal_conv_rows(mixed, weights.conv)
        q, k, v = self._heads(F.silu(convolved))
        g, beta = decay_and_beta(a, b, weights.A_log, weights.dt_bias)
        if not layout.is_packed:
            return chunked_gated_delta_rule(q, k, v, g, beta)[0].to(v.dtype), None
        core = packed_gated_delta_rule(q, k, v, g, beta, layout.cu_seqlens, layout.max_seqlen,
                                       self.delta_backend, final_state)  # fmt: skip
        return core if final_state else (core, None)
