"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, Moonlight).

    q      = q_b(RMSNorm(q_a(x)))  or  q_proj(x)              [nh, nope + rope] per token
    latent = RMSNorm(kv_a(x)[:kv_lora_rank]),  k_rope = kv_a(x)[kv_lora_rank:]   one per token
    k, v   = kv_b(latent) split per head into [nope] and [v_head_dim]; k gets k_rope appended
    out    = o_proj(softmax(q k^T * scale) v)

RoPE turns the last qk_rope_head_dim dimensions of q and the shared k_rope (interleaved pairs
when rope_interleave); the softmax scale is (nope + rope)^-0.5, times mscale(factor,
mscale_all_dim)^2 under YaRN. What a token leaves for later tokens is its latent and k_rope
(kv_lora_rank + qk_rope_head_dim elements: the engine's "latent" cache kind); this module
runs the expanded form, which training and prefill use. Parameter names are HF's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.attention import Attend
from hybridflow.models.norm import RMSNorm
from hybridflow.models.rope import apply_rope

# DeepSeek's q_a_layernorm and kv_a_layernorm keep HF's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs: x [..., n, d] holds (x0, x1), (x2, x3), ... each turned by
    one frequency; cos/sin [..., d] (each frequency twice, rope.rope_cos_sin's layout). The
    result lists the first members of the pairs, then the second ones (HF's layout; q and k
    get the same order, so their dot products are those of the pairs)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def mla_softmax_scale(config) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim)^-0.5, times mscale^2 under YaRN with
    mscale_all_dim (DeepSeek's reference folds the YaRN magnitude into every dimension)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    factor, mscale_all_dim = float(scaling.get("factor", 1.0)), scaling.get("mscale_all_dim")
    if config.rope_type != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_dim, self.v_dim = self.nope_dim + self.rope_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim),
                                   bias=False)  # fmt: skip
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.interleaved = config.rope_interleave
        self.scale = mla_softmax_scale(config)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            return apply_rope_interleaved(x, cos, sin)
        return apply_rope(x, cos, sin)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> q [..., nh, nope + rope], its rope part turned."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.unflatten(-1, (-1, self.qk_dim)).split(
            [self.nope_dim, self.rope_dim], -1
        )
        return torch.cat((q_nope, self._rope(q_rope, cos, sin)), dim=-1)

    def project_latent(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> (the normed latent [..., kv_lora_rank], k_rope [..., rope] turned):
        what a token keeps for the tokens after it."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        k_rope = self._rope(k_rope.unsqueeze(-2), cos, sin).squeeze(-2)
        return self.kv_a_layernorm(latent), k_rope

    def expand(
        self, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [..., r], k_rope [..., rope]) -> k [..., nh, nope + rope], v [..., nh, v]."""
        kv = self.kv_b_proj(latent).unflatten(-1, (-1, self.nope_dim + self.v_dim))
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = k_rope.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        q = self.project_q(x, cos, sin)
        k, v = self.expand(*self.project_latent(x, cos, sin))
        return self.o_proj(attend_expanded(q, k, v, self.scale, attend).flatten(-2))


def attend_expanded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attend: Attend
) -> torch.Tensor:
    """Attention of MLA's expanded heads through the decoder's attend function (the packed
    flash varlen kernel on CUDA, SDPA elsewhere), whose kernels take one head width and
    scale by its inverse square root: q, k and v are zero-padded to the wider of the q/k
    (192 for V3) and v (128) widths, which leaves the scores unchanged, q is pre-scaled to
    give ``scale``, and the output is cut back to v's width."""
    width = max(q.shape[-1], v.shape[-1])
    q = q * (scale * math.sqrt(width))
    if q.shape[-1] < width:
        q, k = F.pad(q, (0, width - q.shape[-1])), F.pad(k, (0, width - k.shape[-1]))
    v_width = v.shape[-1]
    if v_width < width:
        v = F.pad(v, (0, width - v_width))
    return attend(q, k, v)[..., :v_width]
