"""An MLA layer's token mixer in the engine's eager passes (prefill.py, layers/eager.py),
over the latent cache kind (cache/latent.py).

- prefill: the expanded form the model's forward runs (every head's k/v up-projected from the
  prompt's latents, the packed attention), the latents written into the cache;
- decode and extend: each row's latent written, then the absorbed form
  (models/mixers/mla_absorbed.py) over its slot's cached latents: W_UK folded into q,
  scores against the latents and rope keys, the output taken back through W_UV, then
  o_proj. ``step`` "torch" gathers the rows' latents (the pure reference); "triton" reads
  the paged latents in place (kernels/latent_attention.py), no host sync, so decode steps
  replay as CUDA graphs, and turns q and the rope key, norms the latent and stores it in one
  launch (kernels/latent_rope.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.models.mixers.mla import attend_expanded
from hybridflow.models.mixers.mla_absorbed import (
    absorb_query,
    absorbed_attention,
    absorbed_weights,
    expand_output,
)

STEPS = ("torch", "triton")


def _project_and_store(mixer, normed, cos, sin, cache, index: int, at: tuple):
    """q (rope part turned), and the rows' latent and rope key written at `at` (entries,
    offsets) -> (q, latent, k_rope)."""
    q = mixer.project_q(normed, cos, sin)
    latent, k_rope = mixer.project_latent(normed, cos, sin)
    cache.latent[cache.latent_row(index), at[0], at[1]] = torch.cat((latent, k_rope), dim=-1)
    return q, latent, k_rope


def _project_and_store_fused(mixer, normed, cos, sin, cache, index: int, at: tuple):
    """_project_and_store's q, its writes alike, in three launches: the two projections
    (mla.project_q's and project_latent's linear maps), then kernels/latent_rope.py for the
    ropes, the latent's norm and the store."""
    from hybridflow.engine.kernels.latent_rope import latent_rope_store

    if mixer.q_lora_rank is None:
        q = mixer.q_proj(normed)
    else:
        q = mixer.q_b_proj(mixer.q_a_layernorm(mixer.q_a_proj(normed)))
    q = q.unflatten(-1, (mixer.num_heads, mixer.qk_dim))
    latent = cache.latent[cache.latent_row(index)]
    latent_rope_store(q, mixer.kv_a_proj_with_mqa(normed), mixer.kv_a_layernorm, cos, sin,
                      latent, at[0], at[1], mixer.nope_dim, mixer.interleaved)  # fmt: skip
    return q


def latent_prefill(layer, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                   index: int, at: tuple, attend: Callable) -> torch.Tensor:  # fmt: skip
    """Packed prompts [N, H] (attend: the packed attention over them) -> the mixer's output
    [N, H], the expanded form; every token's latent to the cache at `at`."""
    mixer = getattr(layer, layer.mixer_name)
    q, latent, k_rope = _project_and_store(mixer, normed, cos, sin, cache, index, at)
    k, v = mixer.expand(latent, k_rope)
    return mixer.o_proj(attend_expanded(q, k, v, mixer.scale, attend).flatten(-2))


def latent_cached(layer, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                  index: int, at: tuple, row_slots: torch.Tensor, lengths: torch.Tensor,
                  max_len: int, step: str = "torch") -> torch.Tensor:  # fmt: skip
    """Rows [B, H] (a decode token each, or an extend pass's new tokens in causal order),
    each attending to positions [0, lengths[b]) of its slot row_slots[b] once its own latent
    is written at `at` -> the mixer's output [B, H], absorbed. max_len: a bound on lengths
    (static under CUDA graphs; the torch step reads that many positions a row)."""
    if step not in STEPS:
        raise ValueError(f"latent step {step!r}: one of {STEPS}")
    mixer = getattr(layer, layer.mixer_name)
    if step == "triton" and cache.latent.dtype == normed.dtype:
        q = _project_and_store_fused(mixer, normed, cos, sin, cache, index, at)
    else:
        q, _, _ = _project_and_store(mixer, normed, cos, sin, cache, index, at)
    w_uk, w_uv = absorbed_weights(mixer)
    q_nope, q_rope = q.split([mixer.nope_dim, mixer.rope_dim], dim=-1)
    q_latent = absorb_query(q_nope, w_uk)
    latents = cache.latent[cache.latent_row(index)]
    if step == "triton":
        from hybridflow.engine.kernels.latent_attention import latent_decode_attention

        out = latent_decode_attention(q_latent, q_rope, latents, row_slots, lengths, mixer.scale,
                                      mixer.kv_lora_rank, cache.block_table)  # fmt: skip
    else:
        gathered = cache.gather(latents, row_slots, max_len)  # [B, max_len, r + rope]
        visible = torch.arange(max_len, device=normed.device)[None, :] < lengths[:, None]
        latent, k_rope = gathered.split([mixer.kv_lora_rank, mixer.rope_dim], dim=-1)
        out = absorbed_attention(q_latent, q_rope, latent, k_rope, visible, mixer.scale)
    return mixer.o_proj(expand_output(out.to(q_latent.dtype), w_uv).flatten(-2))
