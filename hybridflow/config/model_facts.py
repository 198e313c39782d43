"""What validation reads off a model without loading its weights (a preset or a directory's
config.json): its context length, whether it has experts or a vision encoder, and the column a
run's images come from."""

from __future__ import annotations

from pathlib import Path

from hybridflow.config.sections import Config


def model_context_length(path: str) -> int | None:
    """Max positions of the model at ``path`` without loading weights; None if unknown."""
    import json

    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        try:
            return int(json.loads((p / "config.json").read_text()).get("max_position_embeddings"))
        except (ValueError, TypeError, AttributeError, RecursionError, OSError):
            return None  # an unreadable config.json is reported by the model checks
    try:
        from hybridflow.models.presets import PRESETS

        preset = PRESETS.get(path)
        if preset is not None:
            cfg = preset() if callable(preset) else preset
            return int(cfg.max_position_embeddings)
    except ImportError:
        pass
    return None


def model_has_experts(path: str) -> bool | None:
    """Whether the model at ``path`` (a preset or a directory) is a mixture of experts, read
    without loading weights; None if unknown."""
    import json

    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        try:
            hf = json.loads((p / "config.json").read_text())
            keys = ("num_experts", "num_local_experts", "n_routed_experts")
            return any(int(hf.get(key) or 0) > 0 for key in keys)
        except (ValueError, TypeError, AttributeError, RecursionError, OSError):
            return None  # an unreadable config.json is reported by the model checks
    from hybridflow.models.presets import PRESETS

    return PRESETS[path].is_moe if path in PRESETS else None


RECURRENT_LAYER_TYPE = "linear_attention"
"""config.json's layer_types name of a Gated DeltaNet layer (a recurrent state a sequence)."""
RECURRENT_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
"""Families whose layers default to Gated DeltaNet ones when config.json lists none."""


def model_has_recurrent_layers(path: str) -> bool | None:
    """Whether the model at ``path`` (a preset or a directory) has recurrent layers (Gated
    DeltaNet), read without loading weights; None if unknown."""
    import json

    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        try:
            hf = json.loads((p / "config.json").read_text())
            hf = hf.get("text_config") or hf
            if hf.get("layer_types"):
                return RECURRENT_LAYER_TYPE in hf["layer_types"]
            return hf.get("model_type") in RECURRENT_MODEL_TYPES
        except (ValueError, TypeError, AttributeError, RecursionError, OSError):
            return None  # an unreadable config.json is reported by the model checks
    from hybridflow.models.presets import PRESETS

    if path not in PRESETS:
        return None
    return any(spec.recurrent for spec in PRESETS[path].layer_specs())


def model_reads_images(path: str) -> bool | None:
    """Whether the model at ``path`` (a preset or a directory) runs a vision encoder on
    prompts with images, read without loading weights; None if unknown."""
    import json

    from hybridflow.model_config_values import VISION_MODEL_TYPES

    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        try:
            return (
                json.loads((p / "config.json").read_text()).get("model_type") in VISION_MODEL_TYPES
            )
        except (ValueError, TypeError, AttributeError, RecursionError, OSError):
            return None  # an unreadable config.json is reported by the model checks
    from hybridflow.models.presets import PRESETS

    preset = PRESETS.get(path)
    if callable(preset):
        preset = preset()
    return None if preset is None else getattr(preset, "vision", None) is not None


def trained_model(cfg: Config) -> str:
    """The model the run trains: a warm start's preset (sft:<task>), else model.path."""
    return cfg.sft.preset if cfg.model.path.startswith("sft:") else cfg.model.path


def image_key(cfg: Config) -> str | None:
    """The column the rows' images are read from: data.image_key, else verl's ``images``
    for a vision-language model; None for a text-only one."""
    if cfg.data.image_key is not None:
        return cfg.data.image_key
    return "images" if model_reads_images(trained_model(cfg)) else None


def model_paths(cfg: Config, use_reference: bool, use_critic: bool) -> list[tuple[str, str]]:
    """(key, path) of every model directory the run loads besides presets: the policy, a
    reference or critic of its own, the reward model."""
    paths = [("model.path", cfg.model.path), ("ref.path", cfg.ref.path if use_reference else None),
             ("critic.path", cfg.critic.path if use_critic else None),
             ("reward.model.path", cfg.reward.model.path)]  # fmt: skip
    return [(key, path) for key, path in paths if path]
