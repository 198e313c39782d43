"""Qwen3.5 (dense and MoE) and Qwen3-Next: the hybrid family. Three of every four layers are
Gated DeltaNet (linear attention with a recurrent state), every fourth is gated attention; the
MLP is dense (Qwen3.5) or routed experts + a shared expert (Qwen3.5-MoE on every layer,
Qwen3-Next on the layers its decoder_sparse_step and mlp_only_layers make sparse).

config.json: ``layer_types`` names each layer ("linear_attention" / "full_attention"; absent,
every full_attention_interval-th layer is attention), ``linear_*`` the DeltaNet heads, and
``rope_parameters.partial_rotary_factor`` the part of each attention head RoPE turns (its
mRoPE sections matter only for image positions: text positions are equal in all three).

The published checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``): their config
nests the text model under ``text_config`` (its ``rope_parameters`` carry the interleaved
mRoPE sections the attention layers turn image positions by) and the encoder under
``vision_config`` (models/vision/qwen3_5.py); their weights sit under
``model.language_model.`` and ``model.visual.``. The multi-token-prediction head (``mtp.``)
is not used. A model with its encoder is written back in that layout; a text model as
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, which transformers loads as is.

Qwen3-Next holds the same DeltaNet weights fused per key head: ``in_proj_qkvz`` rows are, for
each key head, its q, its k, then the v and z of the value heads it serves; ``in_proj_ba``
likewise b then a. They are split into Qwen3.5's ``in_proj_qkv``/``in_proj_z``/
``in_proj_b``/``in_proj_a`` on reading and fused back on writing (a row permutation: exact).
"""

from __future__ import annotations

from typing import Any

from hybridflow.models.layer_spec import LayerSpec

ARCHITECTURES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
MODEL_TYPES = tuple(ARCHITECTURES)
# a multimodal model_type -> its language model's
TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MOE_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
NEXT = "qwen3_next"  # experts on the sparse-step layers only; fused DeltaNet projections
# On disk each expert is its own tensors under mlp.experts.{e} (expert_checkpoint.py).
PER_EXPERT_NAMES = {
    model_type: ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    for model_type in MOE_TYPES
}
MIXER_OF_LAYER_TYPE = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}
_MULTIMODAL_PREFIX = "model.language_model."
_VISION_PREFIX = "model.visual."
_NOT_USED_PREFIXES = ("mtp.",)
# the multimodal architectures, by the text model_type they hold
MULTIMODAL_OF = {"qwen3_5_text": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
                 "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")}  # fmt: skip
_TOKEN_ID_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id",
                  "vision_end_token_id")  # fmt: skip
DEFAULT_MROPE_SECTION = (11, 11, 10)  # every published Qwen3.5's (32 pairs: 64 rotary dims)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a multimodal config.json (``text_config`` with the
    top level's token ids and tying where it lacks them); a text config as it is. The MoE
    configs have no dense MLP width: 0."""
    text = dict(hf)
    if is_multimodal(hf):
        text = dict(hf["text_config"])
        text["model_type"] = TEXT_MODEL_TYPES[hf["model_type"]]
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                    "torch_dtype", "dtype"):  # fmt: skip
            if text.get(key) is None and hf.get(key) is not None:
                text[key] = hf[key]
        if isinstance(hf.get("vision_config"), dict):  # the encoder and its token ids
            text["vision_config"] = hf["vision_config"]
            text.update({key: hf[key] for key in _TOKEN_ID_KEYS if hf.get(key) is not None})
    if text.get("model_type") in MOE_TYPES:
        text.setdefault("intermediate_size", 0)
    return text


def is_multimodal(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in TEXT_MODEL_TYPES and isinstance(hf.get("text_config"), dict)


def read_tensor(arch, name: str, tensor) -> list[tuple[str, Any]]:
    """A checkpoint tensor -> [(our name, tensor)]: the multimodal prefix dropped, the vision
    tower and multi-token prediction skipped ([]), Qwen3-Next's fused projections split."""
    if name.startswith(_NOT_USED_PREFIXES) or (
        name.startswith(_VISION_PREFIX) and arch.vision is None
    ):
        return []
    if name.startswith(_VISION_PREFIX):
        return [("visual." + name.removeprefix(_VISION_PREFIX), tensor)]
    if name.startswith(_MULTIMODAL_PREFIX):
        name = "model." + name.removeprefix(_MULTIMODAL_PREFIX)
    if arch.model_type == NEXT and name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
        return _split_fused(arch, name, tensor)
    return [(name, tensor)]


def _widths(arch) -> tuple[int, int, int]:
    """(key heads, each key head's fused qkvz rows, each key head's value heads)."""
    group = arch.linear_num_value_heads // arch.linear_num_key_heads
    rows = 2 * arch.linear_key_head_dim + 2 * group * arch.linear_value_head_dim
    return arch.linear_num_key_heads, rows, group


def _split_fused(arch, name: str, tensor) -> list[tuple[str, Any]]:
    """in_proj_qkvz [Hk * (2Dk + 2G*Dv), H] -> in_proj_qkv, in_proj_z; in_proj_ba [Hk * 2G, H]
    -> in_proj_b, in_proj_a. A tensor of another shape stays as it is (reported missing)."""
    import torch

    heads, rows, group = _widths(arch)
    prefix = name.rsplit(".", 2)[0]
    if name.endswith("in_proj_ba.weight"):
        if tensor.shape[0] != heads * 2 * group:
            return [(name, tensor)]
        b, a = tensor.unflatten(0, (heads, 2 * group)).split([group, group], dim=1)
        return [(f"{prefix}.in_proj_b.weight", b.flatten(0, 1)),
                (f"{prefix}.in_proj_a.weight", a.flatten(0, 1))]  # fmt: skip
    if tensor.shape[0] != heads * rows:
        return [(name, tensor)]
    dk, values = arch.linear_key_head_dim, group * arch.linear_value_head_dim
    q, k, v, z = tensor.unflatten(0, (heads, rows)).split([dk, dk, values, values], dim=1)
    qkv = torch.cat([part.flatten(0, 1) for part in (q, k, v)])
    return [(f"{prefix}.in_proj_qkv.weight", qkv), (f"{prefix}.in_proj_z.weight", z.flatten(0, 1))]


def write_tensors(arch, state: dict):
    """Our state -> the checkpoint's tensors: Qwen3-Next's DeltaNet projections fused back
    per key head; everything else as it is."""
    import torch

    if arch.vision is not None:  # the published multimodal layout
        for name, tensor in state.items():
            if name.startswith("visual."):
                name = _VISION_PREFIX + name.removeprefix("visual.")
            elif name.startswith("model."):
                name = _MULTIMODAL_PREFIX + name.removeprefix("model.")
            yield name, tensor
        return
    if arch.model_type != NEXT:
        yield from state.items()
        return
    heads, _, group = _widths(arch)
    dk, values = arch.linear_key_head_dim, group * arch.linear_value_head_dim
    for name, tensor in state.items():
        prefix = name.rsplit(".", 2)[0]
        if name.endswith("in_proj_qkv.weight"):
            q, k, v = tensor.split([heads * dk, heads * dk, heads * values])
            z = state[f"{prefix}.in_proj_z.weight"]
            parts = [x.unflatten(0, (heads, -1)) for x in (q, k, v, z)]
            yield f"{prefix}.in_proj_qkvz.weight", torch.cat(parts, dim=1).flatten(0, 1)
        elif name.endswith("in_proj_b.weight"):
            a = state[f"{prefix}.in_proj_a.weight"]
            parts = [x.unflatten(0, (heads, group)) for x in (tensor, a)]
            yield f"{prefix}.in_proj_ba.weight", torch.cat(parts, dim=1).flatten(0, 1)
        elif not name.endswith(("in_proj_z.weight", "in_proj_a.weight")):
            yield name, tensor


def layer_types_of(hf: dict[str, Any]) -> tuple[str, ...]:
    layers = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = int(hf.get("full_attention_interval") or 4)
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    )


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attn_output_gate", True) is False:  # every published config gates; ours always
        raise ValueError("attn_output_gate=false (attention without its output gate)")
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
    if isinstance(hf.get("vision_config"), dict):
        from hybridflow.models.vision.spec import VisionSpec

        fields.update(
            vision=VisionSpec.from_hf(hf["vision_config"], hf, kind="qwen3_5"),
            mrope_section=tuple(int(s) for s in rope.get("mrope_section") or DEFAULT_MROPE_SECTION),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        )
    if hf.get("model_type") in MOE_TYPES:
        fields.update(
            num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=True,  # Qwen3.5-MoE's router always renormalises its top-k
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
        )
    if hf.get("model_type") == NEXT:  # its router reads the flag; sparse-step layers only
        fields.update(
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
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
        if model_type != NEXT:
            hf.pop("intermediate_size", None)
    if model_type == NEXT:
        hf.update(norm_topk_prob=arch.norm_topk_prob, decoder_sparse_step=arch.decoder_sparse_step,
                  mlp_only_layers=list(arch.mlp_only_layers))  # fmt: skip
    return hf


def nest_config(arch, flat: dict[str, Any]) -> dict[str, Any]:
    """A model with its encoder: the multimodal config.json (text_config with the interleaved
    mRoPE sections, vision_config, the image token ids); a text model's as it is."""
    if arch.vision is None:
        return flat
    text = dict(flat)
    for key in ("architectures", "torch_dtype", "tie_word_embeddings"):
        text.pop(key, None)
    text["rope_parameters"] = {**text["rope_parameters"],
                               "mrope_section": list(arch.mrope_section),
                               "mrope_interleaved": arch.mrope_interleaved}  # fmt: skip
    model_type, architecture = MULTIMODAL_OF[text["model_type"]]
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": arch.vision.to_hf(),
        **arch.vision.token_ids_to_hf(),
        "tie_word_embeddings": arch.tie_word_embeddings,
        "torch_dtype": flat.get("torch_dtype"),
    }


def layer_specs(arch) -> list[LayerSpec]:
    from hybridflow.models.families.qwen3_moe import is_sparse_layer

    def mlp(index: int) -> str:
        if arch.model_type not in MOE_TYPES:
            return "dense"
        sparse = arch.model_type != NEXT or is_sparse_layer(arch, index)
        return "experts_shared" if sparse else "dense"

    return [LayerSpec(MIXER_OF_LAYER_TYPE[kind], mlp(i)) for i, kind in enumerate(arch.layer_types)]


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
    if arch.vision is not None:
        _check_vision(arch)
    if arch.model_type in MOE_TYPES:
        from hybridflow.models.families.qwen3_moe import check_experts

        check_experts(arch)
    elif arch.num_experts:
        raise ValueError(f"model_type={arch.model_type!r} has no experts (qwen3_5_moe_text has)")


def _check_vision(arch) -> None:
    if arch.model_type not in MULTIMODAL_OF:
        raise ValueError(f"model_type={arch.model_type!r} has no vision encoder (qwen3_5_text "
                         "and qwen3_5_moe_text have)")  # fmt: skip
    if arch.vision.out_hidden_size != arch.hidden_size:
        raise ValueError(
            f"vision_config.out_hidden_size={arch.vision.out_hidden_size} must equal the "
            f"language model's hidden_size={arch.hidden_size}"
        )
    pairs = arch.rotary_dim // 2
    if len(arch.mrope_section) != 3 or sum(arch.mrope_section) != pairs:
        raise ValueError(f"mrope_section={list(arch.mrope_section)} must be three sections "
                         f"summing to the rotary pairs, {pairs}")  # fmt: skip
