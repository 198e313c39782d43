"""MLA's decode op in the latent space ("absorbed"): attention over the cached latents
themselves, never expanded to per-head K/V.

kv_b_proj's weight viewed [nh, nope + v, r] splits into W_UK = [:, :nope] and W_UV =
[:, nope:], so the expanded form's k_nope[t, h] = W_UK[h] c[t] and v[t, h] = W_UV[h] c[t]
(c: a token's normed latent, models/mixers/mla.py). By associativity

    q_latent[h] = W_UK[h]^T q_nope[h]                                      [nh, r]
    score[h, t] = (q_latent[h] . c[t] + q_rope[h] . k_rope[t]) * scale
    out[h]      = W_UV[h] (sum_t softmax_t(score[h])[t] c[t])               [nh, v]

equals the expanded attention while reading r + rope values a token (576 for V3) instead of
nh * (qk + v). ``scale`` is the mixer's (YaRN's mscale^2 folded in, mla_softmax_scale). The
functions here are pure: the engine's passes (engine/layers/latent.py) gather the cached
latents, and the Triton kernel (engine/kernels/latent_attention.py) computes the same
``absorbed_attention`` over the paged cache in place.
"""

from __future__ import annotations

import torch


def live_weight(linear: torch.nn.Module) -> torch.Tensor:
    """A projection's weight as its forward applies it: a peft LoRA layer's base weight plus
    its active adapter's scaled product (unmerged adapters, read live at every call)."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    if linear.disable_adapters or linear.merged or not linear.active_adapters:
        return base.weight
    name = linear.active_adapters[0]
    a, b = linear.lora_A[name].weight, linear.lora_B[name].weight
    delta = (b.float() @ a.float()) * linear.scaling[name]
    return (base.weight.float() + delta).to(base.weight.dtype)


def absorbed_weights(mixer) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [nh, nope, r], W_UV [nh, v, r]): views of the mixer's kv_b_proj weight."""
    weight = live_weight(mixer.kv_b_proj).view(mixer.num_heads, -1, mixer.kv_lora_rank)
    return weight[:, : mixer.nope_dim], weight[:, mixer.nope_dim :]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [B, nh, nope] -> q_latent [B, nh, r]."""
    return torch.einsum("bhn,hnr->bhr", q_nope, w_uk.to(q_nope.dtype))


def expand_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The attention's output in the latent space [B, nh, r] -> per head [B, nh, v]."""
    return torch.einsum("bhr,hvr->bhv", out_latent, w_uv.to(out_latent.dtype))


def absorbed_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_latent [B, nh, r], q_rope [B, nh, rope] (turned), latent [B, T, r], k_rope [B, T,
    rope] (turned), visible [B, T] bool -> the attention's output in the latent space [B, nh,
    r]. The softmax in fp32 (a row that sees nothing gets zeros, not NaN)."""
    scores = torch.einsum("bhr,btr->bht", q_latent, latent)
    scores = (scores + torch.einsum("bhp,btp->bht", q_rope, k_rope)).float() * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bht,btr->bhr", probs.to(latent.dtype), latent)


def absorbed_decode(mixer, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                    visible: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One query token per row through an MLA mixer, absorbed: q [B, nh, nope + rope] (its
    rope part turned, mixer.project_q), the rows' cached latent [B, T, r] and k_rope [B, T,
    rope], visible [B, T] -> per-head outputs [B, nh, v] (before o_proj)."""
    w_uk, w_uv = absorbed_weights(mixer)
    q_nope, q_rope = q.split([mixer.nope_dim, mixer.rope_dim], dim=-1)
    out = absorbed_attention(absorb_query(q_nope, w_uk), q_rope, latent, k_rope, visible,
                             mixer.scale)  # fmt: skip
    return expand_output(out, w_uv)
