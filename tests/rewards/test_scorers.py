"""Hand-checked cases for the rule scorers, including tricky math normalisation."""

import pytest

from hybridflow.rewards.scorers import arithmetic, countdown, gsm8k, math_answer


@pytest.mark.parametrize(
    "response, truth, method, expected",
    [
        ("16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", "18", "strict", 1.0),
        ("#### 1,000", "1000", "strict", 1.0),  # thousands separator
        ("#### $18.00", "18", "strict", 1.0),  # dollar sign and trailing zeros
        ("#### -5", "-5", "strict", 1.0),
        ("#### 17", "18", "strict", 0.0),
        ("The answer is 18", "18", "strict", 0.0),  # strict needs the marker
        ("The answer is 18", "18", "flexible", 1.0),
        ("#### 3 then #### 18", "18", "strict", 1.0),  # the last marker counts
        ("it is 18, not 3", "18", "flexible", 0.0),  # flexible takes the LAST number
    ],
)
def test_gsm8k(response, truth, method, expected):
    assert gsm8k.compute_score(response, truth, method=method) == expected


def test_gsm8k_format_score_only_when_an_answer_was_found():
    assert gsm8k.compute_score("#### 7", "8", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "8", format_score=0.1) == 0.0


@pytest.mark.parametrize(
    "response, truth",
    [
        (r"so \boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\tfrac{1}{2}}", r"\frac12"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),  # equal as exact values
        (r"\boxed{.75}", "3/4"),
        (r"\boxed{5 \text{ cm}}", "5"),  # units in \text
        (r"\boxed{10.0}", "10"),  # trailing .0
        (r"\boxed{2.50}", "2.5"),
        (r"\boxed{1,000}", "1000"),
        (r"\boxed{x = 3}", "3"),
        (r"\boxed{50\%}", "50"),
        (r"\boxed{90^\circ}", "90"),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),  # nested braces
        (r"\boxed{\text{(B)}}", "(B)"),
        (r"\boxed{\$18.00}", "18"),
        (r"\boxed{-\dfrac{2}{4}}", "-0.5"),
        (r"\boxed 7$", "7"),
        (r"first \boxed{2}, finally \boxed{3}", "3"),
        (r"\boxed{3}", r"The answer is $\boxed{3}$"),  # boxed ground truth
    ],
)
def test_math_equal_answers(response, truth):
    assert math_answer.compute_score(response, truth) == 1.0


@pytest.mark.parametrize(
    "response, truth",
    [
        (r"\boxed{3}", "4"),
        ("3", "3"),  # no box: no answer
        (r"\boxed{\frac{1}{3}}", "0.33"),  # close is not equal
        (r"\boxed{2} and then \boxed{3}", "2"),  # only the last box counts
        (r"\boxed{12", "12"),  # cut off before the closing brace
        (r"\boxed{(1,2)}", "(2,1)"),
    ],
)
def test_math_wrong_answers(response, truth):
    assert math_answer.compute_score(response, truth) == 0.0


def test_math_last_boxed_balances_braces():
    assert math_answer.last_boxed(r"x \boxed{\frac{a}{b^{2}}} y") == r"\frac{a}{b^{2}}"


TRUTH = {"target": 24, "numbers": [2, 3, 4]}


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<answer>(2 + 4) * 4</answer>", 0.1),  # 4 twice, 3 unused
        ("<answer>2 * 3 * 4</answer>", 1.0),
        ("think... <answer>4 * (3 * 2)</answer>", 1.0),
        ("<answer>2 * 3 * 4 * 1</answer>", 0.1),  # extra number
        ("<answer>2 * 3 + 4</answer>", 0.1),  # 10, wrong value
        ("<answer>__import__('os')</answer>", 0.1),  # never evaluated
        ("<answer>2 ** 3 * 4</answer>", 0.1),  # power is not allowed
        ("<answer>4 / (3 - 3) * 2</answer>", 0.1),
        ("2 * 3 * 4", 0.0),  # no tags
    ],
)
def test_countdown(response, expected):
    assert countdown.compute_score(response, TRUTH) == expected


def test_countdown_uses_exact_fractions():
    # 7 / 3 * 3 is exactly 7 with fractions (a float check could also pass, but 1/3*3
    # style rounding must never reject a correct equation).
    assert (
        countdown.compute_score("<answer>7 / 3 * 3</answer>", {"target": 7, "numbers": [7, 3, 3]})
        == 1.0
    )
    value, used = countdown.evaluate_equation("(10 - 4) / 4")
    assert value == countdown.Fraction(3, 2) and used == [10, 4, 4]


@pytest.mark.parametrize(
    "response, expected",
    [
        ("68", 1.0),
        (" 68 ", 1.0),
        ("#### 68", 1.0),
        ("68.", 1.0),
        ("86", 0.0),
        ("68 69", 0.0),
        ("6 8", 0.0),
        ("", 0.0),
        ("068", 1.0),
    ],
)
def test_arithmetic(response, expected):
    assert arithmetic.compute_score(response, "68") == expected


def test_arithmetic_negative_answers():
    assert arithmetic.compute_score("-12", "-12") == 1.0
    assert arithmetic.compute_score("12", "-12") == 0.0


def test_predictions_vote_together_when_equal():
    from hybridflow.rewards.answers import extract_prediction

    assert extract_prediction("math", r"\boxed{\dfrac{1}{2}}") == extract_prediction(
        "math", r"so \boxed{\frac12}"
    )
    assert extract_prediction("openai/gsm8k", "#### 1,000") == extract_prediction(
        "gsm8k", "#### 1000.00"
    )
    assert extract_prediction("countdown", "<answer>2 * 3</answer>") == "2*3"
    assert extract_prediction("arithmetic", " 68 ") == "68"
    assert extract_prediction("math", "no box") is None
