"""MATH-style answers: the last `\\boxed{...}` of the response, normalised, against the truth.

Normalisation removes what differs between equal answers written differently:
`\\dfrac`/`\\tfrac` -> `\\frac`, `\\frac12` -> `\\frac{1}{2}`, `a/b` -> `\\frac{a}{b}`,
spacing commands and spaces, `\\left`/`\\right`, `$`, degrees, percent signs, units in
`\\text{}`, `x = ` prefixes, thousands separators, trailing `.0`, and a missing leading
zero. When both sides are plain numbers (integers, decimals, fractions) they are also
compared as exact values, so `0.5` equals `\\frac{1}{2}`.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_TEXT_GROUP = re.compile(r"\\(?:text|textbf|mbox|mathrm)\s*\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces) or `\\boxed x`, else None."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(command) :]
    if rest.startswith(" "):  # `\boxed 5` form: up to the next `$` or whitespace
        return rest.strip().split("$")[0].split()[0] if rest.strip() else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for position, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:position]
    return None  # unbalanced: the response was cut off


def _fix_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{x}` -> `\\frac{1}{x}`, `\\frac{a}b` -> `\\frac{a}{b}`."""
    text = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", text)
    text = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\w)", r"\\frac\1{\2}", text)
    return re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", text)


def _strip_units(text: str) -> str:
    """Drop `\\text{...}` groups that follow a value (units); unwrap a text-only answer."""
    without = _TEXT_GROUP.sub("", text).strip()
    if without:
        return without
    return _TEXT_GROUP.sub(r"\1", text)


def normalize_answer(answer: str) -> str:
    """Canonical string of a math answer (see module docstring)."""
    text = answer.strip().replace("\n", "")
    text = re.sub(r"\\(?:left|right)\b", "", text)
    text = re.sub(r"\\[!,;:]|\\ ", "", text)
    text = text.replace("\\$", "").replace("$", "")
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\^\s*\{?\\circ\}?", "", text).replace("\\degree", "")
    text = text.replace("\\%", "").replace("%", "")
    text = _strip_units(text)
    # `x = 5` -> `5` (a single assignment only; `a=b=c` is kept as written).
    if text.count("=") == 1 and re.match(r"^\s*[a-zA-Z]\w*\s*=", text):
        text = text.split("=", 1)[1]
    text = text.replace(" ", "")
    text = _fix_fracs(text)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    text = text.rstrip(".")
    text = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", text)  # `.5` -> `0.5`
    match = re.fullmatch(r"(-?\d+)/(\d+)", text)
    if match:
        text = f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}"
    if re.fullmatch(r"-?\d+\.\d+", text):  # `10.0` -> `10`, `2.50` -> `2.5`
        text = text.rstrip("0").rstrip(".")
    return text


def as_number(normalized: str) -> Fraction | None:
    """Exact value of a normalised integer, decimal or `\\frac{a}{b}`, else None."""
    if re.fullmatch(r"-?\d+(\.\d+)?", normalized):
        return Fraction(normalized)
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", normalized)
    if match and Fraction(match.group(3)) != 0:
        value = Fraction(match.group(2)) / Fraction(match.group(3))
        return -value if match.group(1) else value
    return None


def answers_match(prediction: str, ground_truth: str) -> bool:
    left, right = normalize_answer(prediction), normalize_answer(ground_truth)
    if left == right:
        return True
    left_value, right_value = as_number(left), as_number(right)
    return left_value is not None and left_value == right_value


def compute_score(solution_str: str, ground_truth: str, **_: object) -> float:
    """1.0 if the last boxed answer equals the ground truth (itself boxed or plain)."""
    prediction = last_boxed(solution_str)
    if prediction is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return 1.0 if answers_match(prediction, truth) else 0.0
