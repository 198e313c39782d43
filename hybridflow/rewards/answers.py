"""The answer a response commits to, per data source: what majority voting (maj@n) counts.

Equal answers written differently must vote together, so each extractor returns the
same normalised form its scorer compares.
"""

from __future__ import annotations

from hybridflow.rewards.scorers import countdown, gsm8k, math_answer


def _math(response: str) -> str | None:
    boxed = math_answer.last_boxed(response)
    return None if boxed is None else math_answer.normalize_answer(boxed)


def _countdown(response: str) -> str | None:
    equation = countdown.extract_equation(response)
    return None if equation is None else equation.replace(" ", "")


def _stripped(response: str) -> str | None:
    text = response.strip().removeprefix("####").strip()
    return text or None


EXTRACTORS = {
    "openai/gsm8k": gsm8k.extract_answer,
    "gsm8k": gsm8k.extract_answer,
    "gsm8k_flexible": lambda response: gsm8k.extract_answer(response, "flexible"),
    "lighteval/MATH": _math,
    "DigitalLearningGmbH/MATH-lighteval": _math,
    "HuggingFaceH4/MATH-500": _math,
    "math": _math,
    "hiyouga/geometry3k": _math,
    "countdown": _countdown,
    "arithmetic": _stripped,
}


def extract_prediction(data_source: str, response: str) -> str | None:
    """Normalised final answer of `response`; unknown data sources use the stripped text."""
    return EXTRACTORS.get(data_source, _stripped)(response)
