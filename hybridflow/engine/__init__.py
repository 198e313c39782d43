"""Generation engine: token ids in, token ids + log-probs out (see engine.py; how it works:
docs/engine.md).

Names are imported on first use, so `hybridflow.engine.options` (a plain dataclass, read by
the config) loads without torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Completion": "hybridflow.engine.engine",
    "Engine": "hybridflow.engine.engine",
    "EngineOptions": "hybridflow.engine.options",
    "RequestHandle": "hybridflow.engine.serving.handles",
    "RolloutService": "hybridflow.engine.serving.service",
    "SamplingParams": "hybridflow.engine.sampling",
    "TokenDelta": "hybridflow.engine.serving.handles",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridflow.engine' has no attribute {name!r}")
