"""The built-in arithmetic task: the response must be exactly the integer answer.

`68`, ` 68 ` and `#### 68` score 1 for ground truth `68`; anything else (extra text,
`68.0`, a second number) scores 0, so the reward also teaches the short format.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"(?:####\s*)?(-?\d+)\.?")


def compute_score(solution_str: str, ground_truth: str, **_: object) -> float:
    match = _ANSWER.fullmatch(solution_str.strip())
    if match is None:
        return 0.0
    return 1.0 if int(match.group(1)) == int(str(ground_truth).strip()) else 0.0
