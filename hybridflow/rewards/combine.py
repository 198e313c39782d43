"""Combining reward parts: each sample's score is a weighted sum of the parts that scored
it, with weights per data source.

    weights = resolve_weights({}, {}, model=True, judge=False)   # {"*": {"model": 1.0}}
    scores, metrics = combine_parts({"model": [0.3, 1.2]}, ["chat", "chat"], weights)

Parts: ``rule`` (the data source's scorer or reward.custom_fn), ``model`` (the reward
model), ``judge`` (the generative judge). Pure functions: no config object, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PARTS = ("rule", "model", "judge")
ANY_SOURCE = "*"


def resolve_weights(
    weights: Mapping[str, float],
    source_weights: Mapping[str, Mapping[str, float]],
    *,
    model: bool,
    judge: bool,
) -> dict[str, dict[str, float]]:
    """{data source or "*": {part: weight}} from reward.weights / reward.source_weights.
    Default (no weights given): the rule part alone, or the model and judge parts that are
    on without the rule part (verl's reward model replaces the rule reward)."""
    if weights:
        default = dict(weights)
    elif model or judge:
        default = {part: 1.0 for part, on in (("model", model), ("judge", judge)) if on}
    else:
        default = {"rule": 1.0}
    table = {ANY_SOURCE: default}
    table.update({source: dict(parts) for source, parts in source_weights.items()})
    return table


def used_parts(table: Mapping[str, Mapping[str, float]]) -> set[str]:
    """Parts with a nonzero weight for some data source (the others need not be computed)."""
    return {part for parts in table.values() for part, weight in parts.items() if weight != 0}


def weights_problems(
    weights: Mapping[str, float],
    source_weights: Mapping[str, Mapping[str, float]],
    *,
    model: bool,
    judge: bool,
) -> list[str]:
    """What is wrong with reward.weights / reward.source_weights (one line each)."""
    on = {"rule": True, "model": model, "judge": judge}
    enable = {"model": "set reward.model.path", "judge": "set reward.judge.template"}
    problems = []
    named = [("reward.weights", weights)] + [
        (f"reward.source_weights.{source}", parts) for source, parts in source_weights.items()
    ]
    for key, parts in named:
        if not isinstance(parts, Mapping):
            problems.append(f"{key} must map reward parts {list(PARTS)} to weights")
            continue
        for part, weight in parts.items():
            if part not in PARTS:
                problems.append(f"{key}.{part} is not a reward part: use {', '.join(PARTS)}")
            elif isinstance(weight, bool) or not isinstance(weight, (int, float)):
                problems.append(f"{key}.{part} = {weight!r} must be a number")
            elif weight != 0 and not on[part]:
                problems.append(f"{key}.{part} = {weight} weighs the {part} reward, which is "
                                f"off: {enable[part]}, or drop the weight")  # fmt: skip
    return problems


def combine_parts(
    parts: Mapping[str, Sequence[float]],
    data_sources: Sequence[str],
    table: Mapping[str, Mapping[str, float]],
) -> tuple[list[float], dict[str, float]]:
    """score_i = Σ_part weight(source_i, part) · parts[part][i], and per part the mean, min
    and max of its raw scores (``reward/<part>/mean``, ...). A part missing from ``parts``
    counts 0 (it was not computed because its weight is 0 everywhere)."""
    size = len(data_sources)
    scores = [0.0] * size
    for i, source in enumerate(data_sources):
        weights = table.get(source, table[ANY_SOURCE])
        scores[i] = sum(weight * float(parts[part][i]) for part, weight in weights.items()
                        if weight != 0 and part in parts)  # fmt: skip
    metrics: dict[str, float] = {}
    for part, values in parts.items():
        if len(values) != size:
            raise ValueError(f"reward part {part!r} has {len(values)} scores for {size} samples")
        if size:
            metrics[f"reward/{part}/mean"] = sum(values) / size
            metrics[f"reward/{part}/min"] = float(min(values))
            metrics[f"reward/{part}/max"] = float(max(values))
    return scores, metrics
