"""Cache kinds: what the engine keeps for each layer of a sequence, read off the layer specs
(models/layer_spec.py), never off the family name.

A kind is one of two shapes:

- **per position**: grows with the sequence and lives in the slot cache's rows or the paged
  cache's blocks (kv_cache.py), so a prompt's full blocks are shared by its samples, grown
  as it decodes and freed with it: K/V of attention layers, MLA's latent
  (``kv_lora_rank + qk_rope_head_dim`` a token instead of K and V: latent.py).
- **per sequence**: a fixed size whatever the length, one slot per sequence (beside the
  blocks, indexed by the sequence's slot): Gated DeltaNet's conv and SSM state
  (:class:`RecurrentStates`), a sliding layer's ring of a window's K/V (window.py). Copied to a prompt's other samples once after its prefill,
  rebuilt by the prefill of a preempted request, continued by a kept conversation's turn.

The scheduler sees sequences (slots) and blocks, not kinds: ``KVCache.copy_sequences`` copies
whatever per-sequence kinds a cache holds, and ``make_cache`` counts them in its budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engine.cache.arithmetic import FUSED_MIXERS, FUSED_MLPS

# Layer kinds the engine's own passes run (prefill.py, layers/eager.py): mixers whose cache
# exists, MLPs the torch passes call (layers/moe.mlp_torch). The rest run on the slow path
# (slow.py).
ENGINE_MIXERS = ("attention", "gated_attention", "gated_deltanet", "sink_attention", "mla")
ENGINE_MLPS = ("dense", "experts", "experts_shared", "biased_experts", "grouped_experts_shared")
# Mixers whose sliding-window layers keep a window's ring (window.py) instead of every position
WINDOWED_MIXERS = ("sink_attention",)


def unfused_kinds(specs) -> list[str]:
    """The layer kinds of these specs the fused decode layers do not run, as "X and Y
    layers" (mixers) and "Z MLPs" (empty: they run every layer)."""
    mixers = sorted({spec.mixer for spec in specs if spec.mixer not in FUSED_MIXERS})
    mlps = sorted({spec.mlp for spec in specs if spec.mlp not in FUSED_MLPS})
    kinds = [f"{' and '.join(mixers)} layers"] if mixers else []
    return kinds + ([f"{' and '.join(mlps)} MLPs"] if mlps else [])


def engine_gaps(specs) -> list[str]:
    """Why the engine's cached passes cannot run a model of these layer specs (empty: they
    can), one line per kind not covered; the engine then takes its slow path."""
    gaps = []
    windows = sorted({spec.window for spec in specs if spec.window})
    if len(windows) > 1:
        gaps.append(f"sliding windows of several sizes {windows}: one ring size expected")
    for spec in specs:
        if spec.mixer not in ENGINE_MIXERS:
            gaps.append(f"{spec.mixer} layers ({spec.cache} cache): not in the engine's passes "
                        "yet")  # fmt: skip
        elif spec.window and spec.mixer not in WINDOWED_MIXERS:
            gaps.append(f"{spec.mixer} layers with a {spec.window}-token window: no windowed "
                        "cache kind yet")  # fmt: skip
        if spec.mlp not in ENGINE_MLPS:
            gaps.append(f"{spec.mlp} MLPs: not in the engine's passes yet")
    return list(dict.fromkeys(gaps))


def layers_by_kind(specs) -> dict[str, tuple[int, ...]]:
    """The model layers of each cache kind the specs name ("kv", "recurrent", "latent"), in
    order: what a cache allocates for each kind (a kind's tensors have one row per layer)."""
    kinds: dict[str, tuple[int, ...]] = {}
    for index, spec in enumerate(specs):
        kinds[spec.cache] = (*kinds.get(spec.cache, ()), index)
    return kinds


def kv_layer_rows(specs) -> list[int | None]:
    """Per model layer, its row of the K/V cache's layer axis (None: it keeps none there; a
    sliding layer keeps its window's ring instead: window.py)."""
    kv = tuple(i for i in layers_by_kind(specs).get("kv", ()) if not specs[i].window)
    return [kv.index(i) if i in kv else None for i in range(len(specs))]


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The per-sequence state of the Gated DeltaNet layers ``layers`` (model indices): the
    conv's last ``kernel - 1`` inputs of its ``conv_dim`` channels in the model dtype, and
    the [heads, key_dim, value_dim] delta-rule state in fp32."""

    layers: tuple[int, ...]
    conv_dim: int
    kernel: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_sequence(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        conv = self.conv_dim * (self.kernel - 1) * element
        return len(self.layers) * (conv + self.heads * self.key_dim * self.value_dim * 4)

    def allocate(self, slots: int, device: torch.device) -> RecurrentStates:
        """Zeroed states for `slots` sequences and a scratch slot (padding rows, finished rows
        and warm-up steps write there)."""
        count = len(self.layers)
        conv = torch.zeros(count, slots + 1, self.conv_dim, self.kernel - 1, dtype=self.dtype,
                           device=device)  # fmt: skip
        ssm = torch.zeros(count, slots + 1, self.heads, self.key_dim, self.value_dim,
                          dtype=torch.float32, device=device)  # fmt: skip
        return RecurrentStates(conv, ssm, {layer: i for i, layer in enumerate(self.layers)})


def recurrent_state_spec(config, dtype: torch.dtype) -> RecurrentStateSpec | None:
    """The recurrent state a model config's layer specs need (None: no recurrent layer)."""
    layers = layers_by_kind(config.layer_specs()).get("recurrent", ())
    if not layers:
        return None
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    return RecurrentStateSpec(layers, 2 * key_dim + value_dim, config.linear_conv_kernel_dim,
                              config.linear_num_value_heads, config.linear_key_head_dim,
                              config.linear_value_head_dim, dtype)  # fmt: skip


@dataclass
class RecurrentStates:
    """conv [L_rec, slots + 1, C, K - 1] and ssm [L_rec, slots + 1, Hv, Dk, Dv] fp32, row
    ``slot`` of each being that sequence's; ``rows`` maps a model layer to its L_rec index."""

    conv: torch.Tensor
    ssm: torch.Tensor
    rows: dict[int, int]

    @property
    def scratch_slot(self) -> int:
        return self.conv.shape[1] - 1

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [slots + 1, C, K - 1], ssm [slots + 1, Hv, Dk, Dv]) of model layer `index`."""
        row = self.rows[index]
        return self.conv[row], self.ssm[row]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Sequence dst[i] takes sequence src[i]'s state in every layer (device index lists:
        the n samples of a prompt from its prefilled slot)."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))
