"""Which reward parts a run computes, read off the ``reward`` config section (the weights
table of rewards/combine.py)."""

from __future__ import annotations

from typing import Any

from hybridflow.rewards.combine import resolve_weights


def weights_table(reward_config: Any) -> dict[str, dict[str, float]]:
    """{data source or "*": {part: weight}} of this config's reward section."""
    return resolve_weights(
        reward_config.weights,
        reward_config.source_weights,
        model=reward_config.model.path is not None,
        judge=reward_config.judge.template is not None,
    )
