"""The values of a Hugging Face config.json, checked before a model is built from them
(no torch): ``hybridflow config validate`` and every model load refuse the same bad value
with the same message."""

from __future__ import annotations

from hybridflow.errors import UserError

# model_type values our own decoder implements; everything else goes to the HF fallback.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")


class ModelConfigError(UserError, ValueError):
    """config.json cannot be read, or holds a value no model can be built from; ``str()``
    says which file, which key and why."""
