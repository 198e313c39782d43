"""Qwen3.5 (dense and MoE): the hybrid family. Three of every four layers are Gated DeltaNet
(linear attention with a recurrent state), every fourth is gated attention; the MLP is dense
(Qwen3.5) or 256 routed experts + a shared expert (Qwen3.5-MoE).

config.json: ``layer_types`` names each layer ("linear_attention" / "full_attention"; absent,
every full_attention_interval-th layer is attention), ``linear_*`` the DeltaNet heads, and
``rope_parameters.partial_rotary_factor`` the part of each attention head RoPE turns (its
mRoPE sections matter only for image positions: text positions are equal in all three).

The published checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``): their config
nests the text model under ``text_config`` and their weights under ``model.language_model.``;
the vision tower (``model.visual.``) and the multi-token-prediction head (``mtp.``) are not
used yet. What we write is the text model (``Qwen3_5ForCausalLM`` /
``Qwen3_5MoeForCausalLM``), which transformers loads as is.
"""

from __future__ import annotations

from typing import Any

from hybridflow.models.layer_spec import LayerSpec

ARCHITECTURES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}
MODEL_TYPES = tuple(ARCHITECTURES)
# a multimodal model_type -> its language model's
TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MOE_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
# On disk each expert is its own tensors under mlp.experts.{e} (expert_checkpoint.py).
PER_EXPERT_NAMES = {
    model_type: ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    for model_type in MOE_TYPES
}
MIXER_OF_LAYER_TYPE = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}
_MULTIMODAL_PREFIX = "model.language_model."
_NOT_USED_PREFIXES = ("model.visual.", "mtp.")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a multimodal config.json (``text_config`` with the
    top level's token ids and tying where it lacks them); a text config as it is. The MoE
    configs have no dense MLP width: 0."""
    text = dict(hf)
    if is_multimodal(hf):
        text = dict(hf["text_config"])
        text["model_type"] = TEXT_MODEL_TYPES[hf["model_type"]]
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
            if text.get(key) is None and hf.get(key) is not None:
                text[key] = hf[key]
    if text.get("model_type") in MOE_TYPES:
        text.setdefault("intermediate_size", 0)
    return text


def is_multimodal(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in TEXT_MODEL_TYPES and isinstance(hf.get("text_config"), dict)


def memory_name(name: str) -> str | None:
    """A checkpoint tensor name -> ours (the multimodal prefix dropped); None for tensors of
    parts we do not run (vision tower, multi-token prediction)."""
    if name.startswith(_NOT_USED_PREFIXES):
        return None
    if name.startswith(_MULTIMODAL_PREFIX):
        return "model." + name.removeprefix(_MULTIMODAL_PREFIX)
    return name


def layer_types_of(hf: dict[str, Any]) -> tuple[str, ...]:
    layers = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = int(hf.get("full_attention_interval") or 4)
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    )


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    fields = {
        "attention_bias": bool(hf.get("attention_bias", False)),
        "o_proj_bias": bool(hf.get("attention_bias", False)),
        "qk_norm": True,
        "zero_centered_norms": True,
        "partial_rotary_factor": float(factor),
        "layer_types": layer_types_of(hf),
        "linear_conv_kernel_dim": int(hf.get("linear_conv_kernel_dim", 4)),
        "linear_key_head_dim": int(hf.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(hf.get("linear_value_head_dim", 128)),
        "linear_num_key_heads": int(hf.get("linear_num_key_heads", 16)),
        "linear_num_value_heads": int(hf.get("linear_num_value_heads", 32)),
    }
    if hf.get("model_type") in MOE_TYPES:
        fields.update(
            num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=True,  # Qwen3.5-MoE's router always renormalises its top-k
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
        )
    return fields


def fields_to_hf(arch) -> dict[str, Any]:
    model_type = TEXT_MODEL_TYPES.get(arch.model_type, arch.model_type)
    rope = {"rope_type": "default", "rope_theta": arch.rope_theta,
            "partial_rotary_factor": arch.partial_rotary_factor}  # fmt: skip
    hf: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]],
        "attention_bias": arch.attention_bias,
        "rope_parameters": rope,
        "layer_types": list(arch.layer_types),
        "linear_conv_kernel_dim": arch.linear_conv_kernel_dim,
        "linear_key_head_dim": arch.linear_key_head_dim,
        "linear_value_head_dim": arch.linear_value_head_dim,
        "linear_num_key_heads": arch.linear_num_key_heads,
        "linear_num_value_heads": arch.linear_num_value_heads,
    }
    if model_type in MOE_TYPES:
        hf.update(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
            moe_intermediate_size=arch.moe_intermediate_size,
            shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
            router_aux_loss_coef=arch.router_aux_loss_coef,
            output_router_logits=False,
        )
        hf.pop("intermediate_size", None)
    return hf


def layer_specs(arch) -> list[LayerSpec]:
    mlp = "experts_shared" if arch.model_type in MOE_TYPES else "dense"
    return [LayerSpec(MIXER_OF_LAYER_TYPE[kind], mlp) for kind in arch.layer_types]


def check(arch) -> None:
    if len(arch.layer_types) != arch.num_hidden_layers:
        raise ValueError(
            f"layer_types names {len(arch.layer_types)} layers, num_hidden_layers is "
            f"{arch.num_hidden_layers}"
        )
    unknown = sorted(set(arch.layer_types) - set(MIXER_OF_LAYER_TYPE))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not one of {sorted(MIXER_OF_LAYER_TYPE)}")
    heads, key_heads = arch.linear_num_value_heads, arch.linear_num_key_heads
    if min(heads, key_heads, arch.linear_key_head_dim, arch.linear_value_head_dim) <= 0:
        raise ValueError("linear_num_{key,value}_heads and linear_{key,value}_head_dim must be > 0")
    if heads % key_heads:
        raise ValueError(
            f"linear_num_value_heads={heads} must be a multiple of linear_num_key_heads={key_heads}"
        )
    if arch.linear_conv_kernel_dim < 1:
        raise ValueError("linear_conv_kernel_dim must be positive")
    if arch.model_type in MOE_TYPES:
        from hybridflow.models.families.qwen3_moe import check_experts

        check_experts(arch)
    elif arch.num_experts:
        raise ValueError(f"model_type={arch.model_type!r} has no experts (qwen3_5_moe_text has)")
