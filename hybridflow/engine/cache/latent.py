"""The latent cache kind: what an MLA layer (models/mixers/mla.py) keeps per position.

A token leaves its normed compressed kv (``kv_lora_rank`` values) and its turned rope key
(``qk_rope_head_dim``) for the tokens after it, shared by every head: 576 values a token and
layer for DeepSeek-V3, where GQA-style K/V of its 128 heads would be 128 * (192 + 128).
They live beside K/V in the cache's slots or blocks (kv_cache.KVCache.latent, [L_latent,
entries, positions, width]), so they are paged, shared by a prompt's samples, grown and
freed exactly as K/V are; the engine's budget counts these bytes instead of K/V's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engine.cache.kinds import layers_by_kind


@dataclass(frozen=True)
class LatentSpec:
    """The latent of the MLA layers ``layers`` (model indices): ``rank`` normed latent values
    then ``rope`` rope-key values a position, in the model dtype."""

    layers: tuple[int, ...]
    rank: int
    rope: int
    dtype: torch.dtype

    @property
    def width(self) -> int:
        return self.rank + self.rope

    @property
    def bytes_per_position(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return len(self.layers) * self.width * element

    def allocate(self, entries: int, positions: int, device: torch.device) -> torch.Tensor:
        """Zeroed (as K/V: no stale NaN may reach a masked softmax) [L, entries, positions,
        width]: entries are a slot cache's slots or a paged cache's blocks, scratch included."""
        shape = (len(self.layers), entries, positions, self.width)
        return torch.zeros(shape, dtype=self.dtype, device=device)

    def rows(self, num_layers: int) -> list[int | None]:
        """Per model layer, its row of the latent's layer axis (None: it keeps none)."""
        return [self.layers.index(i) if i in self.layers else None for i in range(num_layers)]


def latent_spec(config, dtype: torch.dtype) -> LatentSpec | None:
    """The latent a model config's layer specs need (None: no MLA layer)."""
    layers = layers_by_kind(config.layer_specs()).get("latent", ())
    if not layers:
        return None
    return LatentSpec(layers, config.kv_lora_rank, config.qk_rope_head_dim, dtype)
