"""verl's geo3k rule: 0.9 for the right boxed answer, 0.1 for <think>...</think> then a box."""

import pytest

from hybridflow.rewards.answers import extract_prediction
from hybridflow.rewards.scorer_registry import default_registry
from hybridflow.rewards.scorers import geo3k


def _response(answer: str) -> str:
    return (
        f"<think>The triangle is a 30-60-90 one, so the long leg is ...</think> \\boxed{{{answer}}}"
    )


@pytest.mark.parametrize(
    "answer, truth",
    [
        (r"2\sqrt{3}", r"2 \sqrt { 3 }"),  # geo3k's spaced LaTeX
        (r"2 \sqrt 3", r"2\sqrt{3}"),
        (r"\frac{5}{2}", "2.5"),
        (r"\dfrac{5}{2}", r"\frac { 5 } { 2 }"),
        ("5/2", r"\frac{5}{2}"),
        ("60", "60"),
        (r"60^\circ", "60"),
        (r"60^{\circ}", "60"),
        ("60.0", "60"),
        (r"x = 7", "7"),
        (r"12 \text{ cm}", "12"),
        (r"\sqrt{12}", r"2\sqrt{3}"),
        (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}"),
        (r"\frac{40}{3}", r"\frac { 40 } { 3 }"),
        (r"8\pi", r"8 \pi"),
    ],
)
def test_right_answers_in_form_score_one(answer, truth):
    assert geo3k.compute_score(_response(answer), truth) == {
        "score": 1.0,
        "acc": 1.0,
        "format": 1.0,
    }


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("3.46", r"2\sqrt{3}"),
        (r"\frac{5}{3}", r"\frac{5}{2}"),
        ("61", "60"),
        ("x", "60"),
        (r"2\sqrt{2}", r"2\sqrt{3}"),
    ],
)
def test_wrong_answers_in_form_score_the_format_part(answer, truth):
    result = geo3k.compute_score(_response(answer), truth)
    assert result == {"score": pytest.approx(0.1), "acc": 0.0, "format": 1.0}


def test_right_answer_out_of_form_scores_the_accuracy_part():
    assert geo3k.compute_score(r"The answer is \boxed{60}.", "60")["score"] == pytest.approx(0.9)
    # the box must follow the thinking: a box inside it only does not count as the format
    inside = r"<think>so \boxed{60}</think> done"
    assert geo3k.compute_score(inside, "60")["format"] == 0.0
    assert geo3k.compute_score("<think>60</think> 60", "60")["score"] == 0.0  # no box


def test_last_box_counts_and_format_score_is_an_option():
    response = r"<think>first \boxed{1}</think> so \boxed{60}"
    assert geo3k.compute_score(response, "60")["acc"] == 1.0
    assert geo3k.compute_score(_response("61"), "60", format_score=0.0)["score"] == 0.0


def test_the_data_source_picks_it_and_majority_voting_reads_the_box():
    spec = default_registry().get(geo3k.GEO3K_DATA_SOURCE)
    assert spec.target.endswith("scorers.geo3k:compute_score")
    assert extract_prediction("hiyouga/geometry3k", _response(r"\dfrac{5}{2}")) == r"\frac{5}{2}"
