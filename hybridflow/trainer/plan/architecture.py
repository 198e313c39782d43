"""The model a config names, as a ModelArchitecture, read without loading weights: the shape
the memory plan, the checkpoint sizes and the preflight checks price."""

from __future__ import annotations


def model_architecture(model_path: str):
    """The ModelArchitecture of a preset or a local HF directory, without loading weights;
    None if unknown (``sft:`` before its warm start, an unreadable config.json)."""
    try:
        from hybridflow.models.architecture_file import directory_architecture
        from hybridflow.models.presets import PRESETS

        if model_path in PRESETS:
            return PRESETS[model_path]
        return directory_architecture(model_path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError):
        return None
