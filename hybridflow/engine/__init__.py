"""Generation engine: token ids in, token ids + log-probs out (see engine.py; how it works:
docs/engine.md)."""

from hybridflow.engine.engine import Completion, Engine
from hybridflow.engine.options import EngineOptions
from hybridflow.engine.sampling import SamplingParams

__all__ = ["Completion", "Engine", "EngineOptions", "SamplingParams"]
