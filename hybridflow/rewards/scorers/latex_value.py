"""The numeric value of a short LaTeX answer: `2\\sqrt{3}`, `\\frac{5}{2}`, `12\\pi`, `3^{2}`.

Two answers that are the same number written differently (`\\frac{\\sqrt{3}}{2}` and
`\\frac{1}{2}\\sqrt{3}`, `\\sqrt{12}` and `2\\sqrt{3}`) normalise to different strings; their
values agree. The grammar is small on purpose: numbers, `+ - * /`, `\\cdot`, `\\times`,
`^`, parentheses and braces, `\\frac`, `\\sqrt` (with an optional index), `\\pi`, and
implicit multiplication (`2\\sqrt{3}`). Anything else (a variable, a word, an interval)
has no value, and such answers are compared as text only. The text is parsed by hand,
never evaluated as Python, and its length is capped so a response cannot make it slow.
"""

from __future__ import annotations

import math
import re

MAX_CHARS = 120
"""Longer answers have no value: a geometry answer is a few symbols, and the cap bounds
the parser's recursion depth and time whatever a response holds."""
_TOKEN = re.compile(r"\d+(?:\.\d+)?|\.\d+|\\[a-zA-Z]+|[-+*/^(){}\[\]]")
_MULTIPLY = {"*", "\\cdot", "\\times"}
_ATOM_START = {"(", "{", "\\frac", "\\sqrt", "\\pi"}
MAX_OPEN_BRACKETS = 24
"""More opening brackets than this and the answer has no value (bounds recursion depth)."""


class _NoValue(ValueError):
    pass


def _tokens(text: str) -> list[str]:
    text = text.replace("pi", "\\pi").replace("\\\\pi", "\\pi")
    tokens, position = [], 0
    for match in _TOKEN.finditer(text):
        if match.start() != position:
            raise _NoValue(text[position : match.start()])
        tokens.append(match.group())
        position = match.end()
    if position != len(text):
        raise _NoValue(text[position:])
    return tokens


class _Parser:
    """Recursive descent over the tokens; each method returns a float."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.at = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise _NoValue(f"expected {expected or 'more'}, got {token}")
        self.at += 1
        return token

    def expression(self) -> float:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> float:
        value = self.signed()
        while True:
            token = self.peek()
            if token in _MULTIPLY:
                self.take()
                value *= self.signed()
            elif token == "/":
                self.take()
                value = _divide(value, self.signed())
            elif token is not None and (token in _ATOM_START or token[0].isdigit()):
                value *= self.power()  # implicit: `2\sqrt{3}`, `3\pi`
            else:
                return value

    def signed(self) -> float:
        if self.peek() in ("+", "-"):
            return -self.signed() if self.take() == "-" else self.signed()
        return self.power()

    def power(self) -> float:
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take()
        exponent = self.signed() if self.peek() in ("+", "-") else self.atom()
        if abs(exponent) > 64:
            raise _NoValue("exponent too large")
        result = base**exponent
        if isinstance(result, complex):
            raise _NoValue("complex value")
        return result

    def atom(self) -> float:
        token = self.take()
        if token[0].isdigit() or token[0] == ".":
            return float(token)
        if token in ("(", "{"):
            value = self.expression()
            self.take(")" if token == "(" else "}")
            return value
        if token == "\\pi":
            return math.pi
        if token == "\\frac":
            return _divide(self.group(), self.group())
        if token == "\\sqrt":
            index = 2.0
            if self.peek() == "[":
                self.take()
                index = self.expression()
                self.take("]")
            radicand = self.group()
            if radicand < 0 or index == 0:
                raise _NoValue("no real root")
            return radicand ** (1.0 / index)
        raise _NoValue(token)

    def group(self) -> float:
        """A braced argument, or a one-digit number (normalize_answer braces `\\frac12`)."""
        if self.peek() == "{":
            self.take()
            value = self.expression()
            self.take("}")
            return value
        token = self.take()
        if len(token) != 1 or not token.isdigit():
            raise _NoValue(token)
        return float(token)


def _divide(numerator: float, denominator: float) -> float:
    if denominator == 0:
        raise _NoValue("division by zero")
    return numerator / denominator


def latex_value(text: str) -> float | None:
    """The number a normalised answer writes, or None when it is not a plain number."""
    if not text or len(text) > MAX_CHARS or sum(map(text.count, "({[")) > MAX_OPEN_BRACKETS:
        return None
    try:
        parser = _Parser(_tokens(text))
        value = parser.expression()
        if parser.peek() is not None:
            return None
    except (_NoValue, OverflowError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


def same_value(left: str, right: str, rel_tol: float = 1e-9) -> bool:
    """Both answers have a value and the values agree (to float rounding, not to the
    decimals a response rounds to: `3.46` is not `2\\sqrt{3}`)."""
    a, b = latex_value(left), latex_value(right)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-12)
