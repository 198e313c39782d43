"""Qwen2.5-VL: a Qwen2 language model (GQA with q/k/v bias, SwiGLU) whose RoPE is
multimodal (three position rows, models/mrope.py), plus a vision encoder
(models/vision/qwen2_5_vl.py) whose features replace the image-pad tokens.

config.json: transformers 5 nests the language model under ``text_config`` (its
``rope_parameters.mrope_section`` cuts each head's frequencies into the three rows) and the
encoder under ``vision_config``; the published checkpoints (transformers 4) hold the language
model's keys at the top level with ``rope_scaling: {"type": "mrope", "mrope_section": ...}``.
Both are read; the nested form is written (what transformers 5 saves, and 4.x loads).

Weights: the published layout, which is also ours in memory and what transformers writes:
``model.*`` (the language model), ``visual.*`` (the encoder), ``lm_head.weight``.
transformers 5's in-memory names (``model.language_model.*``, ``model.visual.*``) are read
too.
"""

from __future__ import annotations

from typing import Any

from hybridflow.models.families import llama
from hybridflow.models.layer_spec import LayerSpec
from hybridflow.models.vision.spec import VisionSpec

ARCHITECTURES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
MODEL_TYPES = tuple(ARCHITECTURES)
TEXT_MODEL_TYPE = "qwen2_5_vl_text"
# published default (Qwen2.5-VL-3B/7B/32B/72B: 128-dim heads, 64 frequency pairs)
DEFAULT_MROPE_SECTION = (16, 24, 24)
_RENAMED_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
# top-level keys a nested config keeps beside text_config
_TOP_LEVEL_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id",
                   "vision_end_token_id", "tie_word_embeddings")  # fmt: skip


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys at one level (nested text_config or the flat published
    form), still named qwen2_5_vl, with ``mrope_section`` read out of the RoPE settings
    (which are otherwise plain RoPE) and vision_config kept for fields_from_hf."""
    text = {key: value for key, value in hf.items() if key != "text_config"}
    if isinstance(hf.get("text_config"), dict):
        nested = dict(hf["text_config"])
        for key in _TOP_LEVEL_KEYS:  # transformers 5 keeps these at the top level
            if hf.get(key) is not None:
                nested[key] = hf[key]
        text.update(nested)
    text["model_type"] = "qwen2_5_vl"
    rope = {}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(text.get(key), dict):
            rope.update(text[key])
    section = rope.get("mrope_section")
    theta = rope.get("rope_theta", text.get("rope_theta", 1000000.0))
    if rope.get("rope_type", rope.get("type", "default")) in ("default", "mrope"):
        text["rope_scaling"] = None
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    text["mrope_section"] = list(section) if section else None
    return text


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    vision = hf.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError("a qwen2_5_vl config.json needs its vision_config")
    section = hf.get("mrope_section") or DEFAULT_MROPE_SECTION
    return {
        **llama.attention_fields({**hf, "model_type": "qwen2"}),  # Qwen2's attention biases
        "mrope_section": tuple(int(s) for s in section),
        "vision": VisionSpec.from_hf(vision, hf),
    }


def nest_config(arch, flat: dict[str, Any]) -> dict[str, Any]:
    """The common config.json entries (written flat) -> transformers 5's nested layout."""
    text = dict(flat)
    for key in ("architectures", "torch_dtype", "rope_scaling", "tie_word_embeddings"):
        text.pop(key, None)
    text["model_type"] = TEXT_MODEL_TYPE
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": arch.rope_theta,
                               "mrope_section": list(arch.mrope_section)}  # fmt: skip
    text.update(sliding_window=None, use_sliding_window=False,
                max_window_layers=arch.num_hidden_layers)  # fmt: skip
    return {
        "architectures": [ARCHITECTURES[arch.model_type]],
        "model_type": arch.model_type,
        "text_config": text,
        "vision_config": arch.vision.to_hf(),
        **arch.vision.token_ids_to_hf(),
        "tie_word_embeddings": arch.tie_word_embeddings,
        "torch_dtype": flat.get("torch_dtype"),
    }


def fields_to_hf(arch) -> dict[str, Any]:
    return {}


def read_tensor(arch, name: str, tensor) -> list[tuple[str, Any]]:
    """transformers 5's in-memory names -> the published ones (ours)."""
    for old, new in _RENAMED_PREFIXES:
        if name.startswith(old):
            return [(new + name.removeprefix(old), tensor)]
    return [(name, tensor)]


def transformers_name(name: str) -> str:
    """A published (our) weight name -> transformers 5's in-memory one: read_tensor's
    inverse, for loading our tensors into transformers' module without a checkpoint."""
    for ours, theirs in (("visual.", "model.visual."), ("model.", "model.language_model.")):
        if name.startswith(ours):
            return theirs + name.removeprefix(ours)
    return name


def layer_specs(arch) -> list[LayerSpec]:
    return [LayerSpec("attention", "dense")] * arch.num_hidden_layers


def check(arch) -> None:
    if arch.num_experts:
        raise ValueError(f"model_type={arch.model_type!r} has no experts")
    if arch.vision is None:
        raise ValueError("a qwen2_5_vl model needs its vision encoder (vision_config)")
    if arch.vision.out_hidden_size != arch.hidden_size:
        raise ValueError(
            f"vision_config.out_hidden_size={arch.vision.out_hidden_size} must equal the "
            f"language model's hidden_size={arch.hidden_size}"
        )
    pairs = arch.rotary_dim // 2
    if len(arch.mrope_section) != 3 or sum(arch.mrope_section) != pairs:
        raise ValueError(
            f"mrope_section={list(arch.mrope_section)} must be three sections summing to "
            f"head_dim / 2 = {pairs}"
        )
