"""Model families: one file per family turns config.json into layer specs and back.

A family module provides:
    ARCHITECTURES        model_type -> the HF ``*ForCausalLM`` class name it writes
    fields_from_hf(hf)   its ModelArchitecture fields beyond the common ones
    fields_to_hf(arch)   its config.json entries beyond the common ones
    check(arch)          raises ValueError for shapes its layers cannot run
    layer_specs(arch)    [LayerSpec(mixer, mlp)], one per layer
and optionally:
    PER_EXPERT_NAMES     model_type -> how its experts are named on disk (expert_checkpoint)
    text_config(hf)      a multimodal config.json -> its language model's
    read_tensor(arch, name, tensor)   a checkpoint tensor -> [(our name, tensor)] ([]: a
                         part not run; several: a fused tensor we hold split)
    write_tensors(arch, state)        our state dict -> (name, tensor) as its checkpoints
                         hold them (before experts are split per expert)
    not_loaded_note(hf, skipped)  one line naming the tensors a load left out, or None
    nest_config(arch, flat)  the config.json to write, from the common entries written flat
                         (a multimodal family's text_config / vision_config layout)

Nothing outside these files branches on model_type: the decoder, the engine, LoRA and the
memory plan ask the layer specs (models/layer_spec.py).
"""

from __future__ import annotations

from types import ModuleType

from hybridflow.models.families import (
    deepseek_v3,
    gpt_oss,
    llama,
    qwen2_5_vl,
    qwen3_5,
    qwen3_moe,
)

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3_moe, qwen3_5, deepseek_v3, gpt_oss, qwen2_5_vl)

# model_type -> its family module
FAMILY_OF: dict[str, ModuleType] = {
    model_type: family for family in FAMILIES for model_type in family.ARCHITECTURES
}

SUPPORTED_MODEL_TYPES = tuple(FAMILY_OF)


def family_of(model_type: str) -> ModuleType:
    if model_type not in FAMILY_OF:
        raise ValueError(
            f"model_type={model_type!r} is not one of {SUPPORTED_MODEL_TYPES}; "
            "load it with load_model(..., backend='hf') instead"
        )
    return FAMILY_OF[model_type]


# model_type -> (module name on disk, {part: per-expert projection name})
PER_EXPERT_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    model_type: names
    for family in FAMILIES
    for model_type, names in getattr(family, "PER_EXPERT_NAMES", {}).items()
}


def text_config(hf: dict) -> dict:
    """The config of the language model ``hf`` describes (itself for a text-only model)."""
    family = FAMILY_OF.get(hf.get("model_type"))
    convert = getattr(family, "text_config", None)
    return hf if convert is None else convert(hf)


def read_tensor(arch, name: str, tensor):
    """A checkpoint tensor of ``arch``'s family -> [(in-memory name, tensor)]."""
    read = getattr(FAMILY_OF[arch.model_type], "read_tensor", None)
    return [(name, tensor)] if read is None else read(arch, name, tensor)


def write_tensors(arch, state: dict):
    """Our state dict -> (name, tensor) pairs in the family's checkpoint layout."""
    write = getattr(FAMILY_OF[arch.model_type], "write_tensors", None)
    return iter(state.items()) if write is None else write(arch, state)


def family_hook(hf: dict, name: str):
    """The optional hook ``name`` of the family of config.json ``hf`` (None without one)."""
    return getattr(FAMILY_OF.get(hf.get("model_type")), name, None)
