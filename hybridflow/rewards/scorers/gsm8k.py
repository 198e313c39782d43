"""GSM8K: the answer follows `####` (strict), or is the last number in the text (flexible)."""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"-?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_FLEXIBLE = re.compile(_NUMBER)


def clean_number(text: str) -> str:
    """Canonical text of a number: no `$`, commas or spaces; `18.00` -> `18`."""
    text = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return text
    return str(value.numerator) if value.denominator == 1 else format(float(value), "g")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The response's final answer; strict needs `#### N`, flexible takes the last number."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    pattern = _STRICT if method == "strict" else _FLEXIBLE
    matches = [
        m.group(1) if method == "strict" else m.group(0) for m in pattern.finditer(solution_str)
    ]
    if not matches:
        return None
    return clean_number(matches[-1])


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    **_: object,
) -> float:
    """`score` if the answer equals the ground truth, `format_score` if one was found."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == clean_number(str(ground_truth)) else format_score
