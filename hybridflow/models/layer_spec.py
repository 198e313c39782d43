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
#   mla              multi-head latent attention: K/V expanded from a compressed latent
#                    (DeepSeek-V2/V3, Kimi-K2, Moonlight)
#   sink_attention   GQA with a learned sink logit per head, full or over a sliding window
#                    (GPT-OSS)
MIXER_KINDS = ("attention", "gated_attention", "gated_deltanet", "mla", "sink_attention")
# Channel mixers (models/mlps/ and models/moe.py):
#   dense           SwiGLU MLP
#   experts         softmax top-k router + routed SwiGLU experts
#   experts_shared  the above plus a shared SwiGLU expert behind a sigmoid gate (Qwen3.5-MoE)
#   grouped_experts_shared  sigmoid scores with a correction bias, group-limited top-k,
#                   scaled weights, plus always-on shared experts (DeepSeek-V3)
#   biased_experts  a router with a bias, experts with biases, SwiGLU clamped (GPT-OSS)
MLP_KINDS = ("dense", "experts", "experts_shared", "grouped_experts_shared", "biased_experts")

# What the engine keeps per sequence for a mixer: "kv" (paged K/V), "recurrent" (a conv
# state and an SSM state, fixed size whatever the length), "latent" (MLA's compressed kv and
# its rope key: kv_lora_rank + qk_rope_head_dim a token).
CACHE_KINDS = {"attention": "kv", "gated_attention": "kv", "gated_deltanet": "recurrent",
               "mla": "latent", "sink_attention": "kv"}  # fmt: skip
# Mixers that also read where the sequences are (TokenLayout), not only the attend function.
LAYOUT_MIXERS = ("gated_deltanet", "sink_attention")

# The HF module name of each mixer inside a decoder layer (parameter names follow HF).
MIXER_MODULE_NAMES = {
    "attention": "self_attn",
    "gated_attention": "self_attn",
    "gated_deltanet": "linear_attn",
    "mla": "self_attn",
    "sink_attention": "self_attn",
}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: ``mixer`` in MIXER_KINDS, ``mlp`` in MLP_KINDS; ``window``: the
    tokens a sliding-window layer attends to (itself included), 0 = the whole prefix."""

    mixer: str = "attention"
    mlp: str = "dense"
    window: int = 0

    def __post_init__(self) -> None:
        if self.mixer not in MIXER_KINDS:
            raise ValueError(f"mixer {self.mixer!r} is not one of {MIXER_KINDS}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp {self.mlp!r} is not one of {MLP_KINDS}")

    @property
    def cache(self) -> str:
        """The engine's cache kind for this layer: "kv", "recurrent" or "latent"."""
        return CACHE_KINDS[self.mixer]

    @property
    def keeps_kv(self) -> bool:
        return self.cache == "kv"

    @property
    def recurrent(self) -> bool:
        """The mixer runs along each sequence with a state (no K/V, no attend function)."""
        return self.cache == "recurrent"

    @property
    def needs_layout(self) -> bool:
        """The mixer is given the TokenLayout (where the sequences are) of a forward."""
        return self.mixer in LAYOUT_MIXERS

    @property
    def paged_kv(self) -> bool:
        """The engine's fused paged-K/V layers run this layer: plain GQA over the whole
        prefix. Gated attention, Gated DeltaNet, sink attention
        (full or windowed) and MLA run the engine's eager passes beside their caches
        (engine/cache/kinds.py)."""
        return self.mixer == "attention" and not self.window

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
# place: Gated DeltaNet's fused q/k/v input for q/k/v, its output gate and out_proj for o_proj;
# MLA's low-rank q and latent k/v projections.
LORA_EQUIVALENTS: dict[str, dict[str, tuple[str, ...]]] = {
    "gated_deltanet": {
        "q_proj": ("in_proj_qkv",),
        "k_proj": ("in_proj_qkv",),
        "v_proj": ("in_proj_qkv",),
        "o_proj": ("in_proj_z", "out_proj"),
    },
    # MLA: q through its rank (or q_proj itself), k and v through the latent's compression
    # and expansion
    "mla": {
        "q_proj": ("q_a_proj", "q_b_proj"),
        "k_proj": ("kv_a_proj_with_mqa", "kv_b_proj"),
        "v_proj": ("kv_a_proj_with_mqa", "kv_b_proj"),
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
