"""Which scorer handles which `data_source`.

A scorer is named by a `ScorerSpec` (an import target plus options) rather than held as
a function object, so it can be sent to a scoring worker process and resolved there:
functions loaded from a user's file cannot be pickled by reference.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.errors import UserError

SCORERS = "hybridflow.rewards.scorers"


@dataclass(frozen=True)
class ScorerSpec:
    """`target` is `package.module:function` or `path/to/file.py:function`.

    `style` says how the function is called:
      builtin: fn(solution_str, ground_truth, extra_info=..., **options) -> float | dict
      custom:  fn(data_source=, solution_str=, ground_truth=, extra_info=) -> float | dict
               (verl's `compute_score` signature, so existing reward files work)
      batch:   fn(data_sources=, solution_strs=, ground_truths=, extra_infos=) -> list
    """

    target: str
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    style: str = "builtin"


class UnknownDataSource(UserError, ValueError):
    """A data source no scorer is registered for; the message lists the known ones."""


class ScorerRegistry:
    """Maps data source names to scorer specs."""

    def __init__(self, specs: dict[str, ScorerSpec] | None = None):
        self._specs: dict[str, ScorerSpec] = dict(specs or {})

    def register(self, data_source: str, spec: ScorerSpec) -> None:
        self._specs[data_source] = spec

    def names(self) -> list[str]:
        return sorted(self._specs)

    def __contains__(self, data_source: str) -> bool:
        return data_source in self._specs

    def get(self, data_source: str) -> ScorerSpec:
        if data_source not in self._specs:
            raise UnknownDataSource(
                f"no reward scorer for data_source {data_source!r}; known: {self.names()}; "
                f"register one or set reward.custom_fn=path/to/file.py:function"
            )
        return self._specs[data_source]

    def check(self, data_sources: Iterable[str]) -> None:
        """Raise for the first data source without a scorer (call before training)."""
        for data_source in sorted(set(data_sources)):
            self.get(data_source)


def default_registry(sandbox_isolation: str = "auto") -> ScorerRegistry:
    """Built-in scorers under the data source names verl's datasets use; the code scorer
    runs programs under `sandbox_isolation` (SandboxLimits.isolation)."""
    gsm8k = ScorerSpec(f"{SCORERS}.gsm8k:compute_score")
    math = ScorerSpec(f"{SCORERS}.math_answer:compute_score")
    # stdin/stdout tests in the sandbox
    code = ScorerSpec(f"{SCORERS}.code:compute_score", {"isolation": sandbox_isolation})
    return ScorerRegistry(
        {
            "openai/gsm8k": gsm8k,
            "gsm8k": gsm8k,
            "gsm8k_flexible": ScorerSpec(f"{SCORERS}.gsm8k:compute_score", {"method": "flexible"}),
            "lighteval/MATH": math,
            "DigitalLearningGmbH/MATH-lighteval": math,
            "HuggingFaceH4/MATH-500": math,
            "math": math,
            "hiyouga/geometry3k": ScorerSpec(f"{SCORERS}.geo3k:compute_score"),
            "countdown": ScorerSpec(f"{SCORERS}.countdown:compute_score"),
            "arithmetic": ScorerSpec(f"{SCORERS}.arithmetic:compute_score"),
            "calc": ScorerSpec(f"{SCORERS}.arithmetic:compute_score"),  # the exact integer
            "shapes": ScorerSpec(f"{SCORERS}.shapes:compute_score"),
            "code": code,
            "codecontests": code,
            "codeforces": code,
        }
    )
