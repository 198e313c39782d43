"""Countdown: an equation in `<answer>` tags that uses each given number exactly once and
evaluates to the target.

The equation is parsed with `ast` and evaluated over exact fractions; only numbers,
+ - * / and parentheses are accepted, so no user text is ever executed and no float
rounding can make a wrong equation pass.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
MAX_EQUATION_CHARS = 200


class InvalidEquation(ValueError):
    pass


def extract_equation(solution_str: str) -> str | None:
    """Text of the last `<answer>...</answer>` block."""
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


def _evaluate(node: ast.AST, numbers: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, numbers)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, numbers), _evaluate(node.right, numbers)
        if isinstance(node.op, ast.Div) and right == 0:
            raise InvalidEquation("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    raise InvalidEquation(f"not allowed in an equation: {ast.dump(node)[:60]}")


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]]:
    """Exact value of the equation and the integers it uses, in order."""
    if len(equation) > MAX_EQUATION_CHARS:
        raise InvalidEquation("equation too long")
    if not re.fullmatch(r"[\d\s+\-*/().]+", equation):
        raise InvalidEquation("equation holds characters other than digits, + - * / ( )")
    try:
        tree = ast.parse(equation, mode="eval")
    except SyntaxError as error:
        raise InvalidEquation(f"not an equation: {error.msg}") from error
    numbers: list[int] = []
    return _evaluate(tree, numbers), numbers


def compute_score(
    solution_str: str, ground_truth: dict, format_score: float = 0.1, score: float = 1.0, **_
) -> float:
    """`score` if correct; `format_score` for a well-formed but wrong equation; else 0."""
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    try:
        value, used = evaluate_equation(equation)
    except InvalidEquation:
        return format_score
    numbers = [int(n) for n in ground_truth["numbers"]]
    if Counter(used) != Counter(numbers):
        return format_score
    return score if value == int(ground_truth["target"]) else format_score
