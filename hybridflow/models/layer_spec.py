"""What one decoder layer is made of: its token mixer and its channel mixer (MLP).

The decoder, the engine, LoRA and the memory plan ask a layer's spec what it holds (does it
keep K/V? a recurrent state? experts?) instead of asking which family the model belongs to.
A family file (models/families/) turns a config.json into one spec per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

# Token mixers: one module kind each (models/mixers/).
#   attention        GQA with RoPE (Llama, Qwen2/3, Mistral, Qwen3-MoE, Mixtral)
#   gated_attention  GQA with an output gate on q, zero-centred QK-norm, partial RoPE (Qwen3.5)
#   gated_deltanet   linear attention with a recurrent state, the gated delta rule (Qwen3.5)
MIXER_KINDS = ("attention", "gated_attention", "gated_deltanet")
# Channel mixers (models/mlps/ and models/moe.py):
#   dense           SwiGLU MLP
#   experts         softmax top-k router + routed SwiGLU experts
#   experts_shared  the above plus a shared SwiGLU expert behind a sigmoid gate (Qwen3.5-MoE)
MLP_KINDS = ("dense", "experts", "experts_shared")

# What the engine keeps per sequence for a mixer: "kv" (paged K/V), "recurrent" (a conv
# state and an SSM state, fixed size whatever the length).
CACHE_KINDS = {"attention": "kv", "gated_attention": "kv", "gated_deltanet": "recurrent"}

# The HF module name of each mixer inside a decoder layer (parameter names follow HF).
MIXER_MODULE_NAMES = {
    "attention": "self_attn",
    "gated_attention": "self_attn",
    "gated_deltanet": "linear_attn",
}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: ``mixer`` in MIXER_KINDS, ``mlp`` in MLP_KINDS."""

    mixer: str = "attention"
    mlp: str = "dense"

    def __post_init__(self) -> None:
        if self.mixer not in MIXER_KINDS:
            raise ValueError(f"mixer {self.mixer!r} is not one of {MIXER_KINDS}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp {self.mlp!r} is not one of {MLP_KINDS}")

    @property
    def cache(self) -> str:
        """The engine's cache kind for this layer: "kv" or "recurrent"."""
        return CACHE_KINDS[self.mixer]

    @property
    def keeps_kv(self) -> bool:
        return self.cache == "kv"

    @property
    def sparse(self) -> bool:
        """The MLP routes tokens to experts (its routing is recorded and replayed)."""
        return self.mlp != "dense"

    @property
    def mixer_module(self) -> str:
        """Attribute name of the mixer in the layer (HF's): ``self_attn`` or ``linear_attn``."""
        return MIXER_MODULE_NAMES[self.mixer]


# LoRA targets are named as attention's projections (model.lora_target_modules: q_proj,
# k_proj, v_proj, o_proj, ...); a mixer of another kind adapts its own projections in their
# place: Gated DeltaNet's fused q/k/v input for q/k/v, its output gate and out_proj for o_proj.
LORA_EQUIVALENTS: dict[str, dict[str, tuple[str, ...]]] = {
    "gated_deltanet": {
        "q_proj": ("in_proj_qkv",),
        "k_proj": ("in_proj_qkv",),
        "v_proj": ("in_proj_qkv",),
        "o_proj": ("in_proj_z", "out_proj"),
    },
}


def lora_target_modules(specs: list[LayerSpec], requested: list[str]) -> list[str]:
    """The module names LoRA adapts in a model of these layers: ``requested`` plus each
    mixer kind's equivalents of the attention projections it names (in order, once)."""
    names = list(requested)
    for mixer in dict.fromkeys(spec.mixer for spec in specs):
        for name in requested:
            names += LORA_EQUIVALENTS.get(mixer, {}).get(name, ())
    return list(dict.fromkeys(names))
