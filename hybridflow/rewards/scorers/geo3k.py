"""Geometry3K (`hiyouga/geometry3k`): verl's rule for its geo3k recipe.

The prompt asks for the reasoning in `<think> </think>` and the final answer in
`\\boxed{}`. The score is `(1 - format_score) * accuracy + format_score * format`, with
format_score 0.1 as verl's: 1.0 for a right answer in the asked-for form, 0.9 for a right
answer without it, 0.1 for a wrong one in form, 0 otherwise.

- format: the response is `<think>...</think>`, then text holding `\\boxed{...}` (the
  whole response matches, as verl's regular expression does);
- accuracy: the last boxed answer equals the ground truth after math normalisation
  (math_answer: `\\dfrac`, spaces, degrees, units, trailing `.0`, exact fractions), or both
  are numbers of the same value (latex_value: `\\frac{\\sqrt{3}}{2}` is
  `\\frac{1}{2}\\sqrt{3}`), as verl's symbolic grader also accepts.

The dict's `acc` and `format` are logged as `reward/extra/acc` and `reward/extra/format`.
"""

from __future__ import annotations

import re

from hybridflow.rewards.scorers.latex_value import same_value
from hybridflow.rewards.scorers.math_answer import answers_match, last_boxed, normalize_answer

GEO3K_DATA_SOURCE = "hiyouga/geometry3k"
FORMAT_SCORE = 0.1
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(solution_str: str) -> float:
    return 1.0 if _FORMAT.fullmatch(solution_str) else 0.0


def accuracy(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer is the ground truth (itself boxed or plain)."""
    prediction = last_boxed(solution_str)
    if prediction is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    if answers_match(prediction, truth):
        return 1.0
    return 1.0 if same_value(normalize_answer(prediction), normalize_answer(truth)) else 0.0


def compute_score(
    solution_str: str, ground_truth: str, format_score: float = FORMAT_SCORE, **_: object
) -> dict[str, float]:
    acc, form = accuracy(solution_str, ground_truth), format_reward(solution_str)
    return {"score": (1.0 - format_score) * acc + format_score * form, "acc": acc, "format": form}
