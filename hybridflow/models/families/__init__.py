"""Model families: one file per family turns config.json into layer specs and back.

A family module provides:
    ARCHITECTURES        model_type -> the HF ``*ForCausalLM`` class name it writes
    fields_from_hf(hf)   its ModelArchitecture fields beyond the common ones
    fields_to_hf(arch)   its config.json entries beyond the common ones
    check(arch)          raises ValueError for shapes its layers cannot run
    layer_specs(arch)    [LayerSpec(mixer, mlp)], one per layer

Nothing outside these files branches on model_type: the decoder, the engine, LoRA and the
memory plan ask the layer specs (models/layer_spec.py).
"""

from __future__ import annotations

from types import ModuleType

from hybridflow.models.families import llama, qwen3_moe

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3_moe)

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
