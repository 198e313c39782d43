"""Generation engine: token ids in, token ids + log-probs out (see engine.py)."""

from hybridflow.engine.engine import Completion, Engine
from hybridflow.engine.sampling import SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
