"""A training step whose loss or gradient norm is not finite stops the run: the optimizer
skips such a step (learners/core.py), but a run where it happens is diverging or fed a
NaN, and would go on to exit 0 with null losses. The step is not saved: the last
checkpoint written before it stays the newest."""

from __future__ import annotations

import math

from hybridflow.errors import UserError


class TrainingDiverged(UserError):
    """A loss or gradient norm became NaN or inf; the message names the step, the values and
    the checkpoint kept."""


def non_finite_update(metrics: dict[str, float], prefix: str) -> str | None:
    """What in an update's ``metrics`` (keys ``<prefix>/…``) is not finite: a loss term, or
    optimizer steps skipped on a NaN or inf gradient norm (``skipped_steps``); None when all
    is finite."""
    problems = [
        f"{key} = {value}"
        for key, value in sorted(metrics.items())
        if key.startswith(f"{prefix}/") and "loss" in key.rsplit("/", 1)[-1]
        and isinstance(value, float) and not math.isfinite(value)
    ]  # fmt: skip
    skipped = metrics.get(f"{prefix}/skipped_steps", 0.0)
    if skipped:
        problems.append(f"the gradient norm was NaN or inf in {skipped:g} optimizer step(s), "
                        "which were skipped")  # fmt: skip
    return "; ".join(problems) or None


def check_update(metrics: dict[str, float], prefix: str, *, step: str, kept: str,
                 fix: str) -> None:  # fmt: skip
    """TrainingDiverged when :func:`non_finite_update` finds something. step: which step
    (``"step 3"``); kept: what was saved before it; fix: what to change."""
    problem = non_finite_update(metrics, prefix)
    if problem is not None:
        raise TrainingDiverged(
            f"{step}: the {prefix} update is not finite ({problem}); the run stops without "
            f"saving this step: {kept}",
            fix,
        )


def kept_checkpoint(latest_step: int | None, directory) -> str:
    """The words for the checkpoint a stopped run keeps."""
    if latest_step is None:
        return "no checkpoint was saved before it"
    return f"the checkpoint of step {latest_step} in {directory} is the newest and is kept"
