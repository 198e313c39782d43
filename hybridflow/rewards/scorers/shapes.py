"""The built-in shapes task (data/shapes.py): the response must be exactly the answer, a
count (`3`) or a colour (`red`), up to surrounding spaces and letter case."""

from __future__ import annotations


def compute_score(solution_str: str, ground_truth: str, **_: object) -> float:
    return 1.0 if solution_str.strip().lower() == str(ground_truth).strip().lower() else 0.0
