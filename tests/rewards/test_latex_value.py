"""The numeric value of short LaTeX answers, and the ones that have none."""

import math

import pytest

from hybridflow.rewards.scorers.latex_value import MAX_CHARS, latex_value, same_value


@pytest.mark.parametrize(
    "text, value",
    [
        ("60", 60.0),
        ("12.5", 12.5),
        ("-3", -3.0),
        (r"\frac{5}{2}", 2.5),
        (r"2\sqrt{3}", 2 * math.sqrt(3)),
        (r"\frac{\sqrt{3}}{2}", math.sqrt(3) / 2),
        (r"\sqrt[3]{8}", 2.0),
        (r"12\pi", 12 * math.pi),
        (r"3^{2}+4^2", 25.0),
        (r"2\cdot(1+2)", 6.0),
        (r"\frac{4}{3}\pi", 4 * math.pi / 3),
        ("8/2", 4.0),
        (r"\frac{1}2", 0.5),  # normalize_answer braces `\frac12` first
    ],
)
def test_values(text, value):
    assert latex_value(text) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize(
    "text",
    [
        "x",
        "x+1",
        r"\text{cm}",
        "(1,2)",
        r"\frac{1}{0}",
        r"\sqrt{-4}",
        "(-8)^{0.5}",
        "2^{1000}",
        "1+",
        "((1)",
        "import os",
        "1" + "(" * 40 + "1" + ")" * 40,
        "1" * (MAX_CHARS + 1),
        "",
    ],
)
def test_no_value(text):
    assert latex_value(text) is None


def test_same_value_is_exact_to_float_rounding_only():
    assert same_value(r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}")
    assert same_value(r"\sqrt{12}", r"2\sqrt{3}")
    assert not same_value("3.46", r"2\sqrt{3}")  # rounded: not the same number
    assert not same_value("x", "x")  # no value: text comparison decides elsewhere
