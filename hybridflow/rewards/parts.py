"""Which reward parts a run computes, read off the ``reward`` config section (the weights
table of rewards/combine.py), and how a run names the score they make."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.rewards.combine import ANY_SOURCE, resolve_weights, used_parts


def weights_table(reward_config: Any) -> dict[str, dict[str, float]]:
    """{data source or "*": {part: weight}} of this config's reward section."""
    return resolve_weights(
        reward_config.weights,
        reward_config.source_weights,
        model=reward_config.model.path is not None,
        judge=reward_config.judge.template is not None,
    )


PART_NAMES = {"rule": "rule reward", "model": "reward-model score", "judge": "judge score"}
"""What each reward part is called where a run says how its score is made."""


def describe_weights(weights: Mapping[str, float]) -> str:
    """One data source's score in words: ``the reward-model score``, or
    ``1 × rule reward + 0.5 × reward-model score``."""
    used = [(part, weight) for part, weight in weights.items() if weight != 0]
    if not used:
        return "0 (every part weighs 0)"
    if len(used) == 1 and used[0][1] == 1:
        return f"the {PART_NAMES[used[0][0]]}"
    return " + ".join(f"{weight:g} × {PART_NAMES[part]}" for part, weight in used)


def rule_reward_alone(table: Mapping[str, Mapping[str, float]]) -> bool:
    """The score is the rule reward alone (its checkers score right or wrong: an accuracy)."""
    return used_parts(table) <= {"rule"}


def score_line(table: Mapping[str, Mapping[str, float]]) -> str | None:
    """What a run says at its start when a reward model or a judge makes the score: whether
    they replace the rule reward or are combined with it; None for the rule reward alone."""
    if rule_reward_alone(table):
        return None
    default = table[ANY_SOURCE]
    others = [part for part, weight in default.items() if weight != 0 and part != "rule"]
    if default.get("rule", 0) == 0:
        both = ", ".join(f"{part}: 1.0" for part in ["rule", *others])
        how = (f"replacing the rule reward (as verl's reward model does; "
               f"reward.weights={{{both}}} combines them)")  # fmt: skip
    else:
        named = " and the ".join(PART_NAMES[part] for part in others) or "nothing else"
        how = f"the rule reward combined with the {named} (reward.weights)"
    line = f"reward: the score is {describe_weights(default)}, {how}"
    for source, weights in table.items():
        if source != ANY_SOURCE:
            line += f"; for {source}: {describe_weights(weights)} (reward.source_weights)"
    return line
