"""The values of a Hugging Face config.json, checked before a model is built from them
(no torch): ``hybridflow config validate`` and every model load refuse the same bad value
with the same message."""

from __future__ import annotations

from hybridflow.errors import UserError


class ModelConfigError(UserError, ValueError):
    """config.json cannot be read, or holds a value no model can be built from; ``str()``
    says which file, which key and why."""
