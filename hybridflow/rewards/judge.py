"""A generative judge: an LLM reads a prompt made from a template file and the sample, and
its reply holds the score.

    judge = JudgeReward(template_text, r"Score: (\\d+)", ask)   # ask: prompts -> outcomes
    result = judge.score(prompts, responses, ground_truths)    # a RewardResult

``ask`` is the engine (rewards/judge_engines.py: the policy's rollout service, or a second
model behind an OpenAI-compatible server). A reply without a score, a score that is not a
finite number of at most MAX_ABS_SCORE (``Score: 999…9``, 5,000 digits, parses to inf), a
request that fails or times out scores 0 and is counted as for rule rewards (``reward/judge/num_errors``,
``reward/judge/num_timeouts``); rewards/monitor.py prints each message once and stops a run
whose judge fails on every sample.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.rewards.managers import MAX_ABS_SCORE, MAX_ERROR_MESSAGES, RewardResult
from hybridflow.rewards.parallel import ScoreOutcome

METRIC_PREFIX = "reward/judge"
SLOTS = ("{prompt}", "{response}", "{ground_truth}")

Ask = Callable[[list[str]], list[ScoreOutcome]]
"""Judge prompts -> one outcome each: status ok with the reply text, or error / timeout."""


def prompt_text(prompt: Any) -> str:
    """A sample's prompt as text: a chat's messages joined as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    try:
        return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
    except (TypeError, KeyError):
        return str(prompt)


def fill_template(template: str, prompt: Any, response: str, ground_truth: Any) -> str:
    """The template with its slots replaced (literally: other braces, e.g. JSON in the
    rubric, stay as written)."""
    values = {"{prompt}": prompt_text(prompt), "{response}": response,
              "{ground_truth}": "" if ground_truth is None else str(ground_truth)}  # fmt: skip
    pattern = re.compile("|".join(re.escape(slot) for slot in SLOTS))
    return pattern.sub(lambda match: values[match.group(0)], template)


def parse_score(reply: str, pattern: re.Pattern) -> float:
    """The last match of ``pattern`` in the reply (group 1 if it has one) as a number;
    ValueError naming the reply when there is none, or it is not finite or past
    MAX_ABS_SCORE (a NaN or inf score would turn the loss into NaN)."""
    matches = list(pattern.finditer(reply))
    if not matches:
        raise ValueError(f"judge reply has no score matching {pattern.pattern!r}: "
                         f"{reply[:120]!r}")  # fmt: skip
    last = matches[-1]
    text = last.group(1) if pattern.groups else last.group(0)
    shown = text if text is None or len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
    try:
        score = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"judge score {shown!r} is not a number (reply {reply[:120]!r})") from None
    if not math.isfinite(score) or abs(score) > MAX_ABS_SCORE:
        raise ValueError(f"judge score {shown!r} is not a finite number of at most "
                         f"{MAX_ABS_SCORE:g} in size (reply {reply[:120]!r})")  # fmt: skip
    return score


class JudgeReward:
    """``score(prompts, responses, ground_truths) -> RewardResult`` through ``ask``."""

    def __init__(self, template: str, score_pattern: str, ask: Ask):
        if "{response}" not in template:
            raise ValueError("the judge template has no {response} slot")
        self.template, self.pattern, self.ask = template, re.compile(score_pattern), ask

    def score(self, prompts: Sequence[Any], responses: Sequence[str],
              ground_truths: Sequence[Any]) -> RewardResult:  # fmt: skip
        questions = [fill_template(self.template, p, r, g)
                     for p, r, g in zip(prompts, responses, ground_truths)]  # fmt: skip
        try:
            outcomes = self.ask(questions)
        except Exception as error:  # the engine itself failed: every sample of the call
            message = f"judge engine: {type(error).__name__}: {error}"
            outcomes = [ScoreOutcome("error", message=message)] * len(questions)
        return self._collect(outcomes)

    def _collect(self, outcomes: list[ScoreOutcome]) -> RewardResult:
        scores, messages, counts = [], [], {"error": 0, "timeout": 0}
        for outcome in outcomes:
            if outcome.status == "ok":
                try:
                    scores.append(parse_score(str(outcome.value), self.pattern))
                    continue
                except ValueError as error:
                    outcome = ScoreOutcome("error", message=str(error))
            scores.append(0.0)
            counts[outcome.status] += 1
            if len(messages) < MAX_ERROR_MESSAGES and outcome.message not in messages:
                messages.append(outcome.message)
        size = max(1, len(scores))
        metrics = {
            f"{METRIC_PREFIX}/num_errors": float(counts["error"]),
            f"{METRIC_PREFIX}/num_timeouts": float(counts["timeout"]),
            f"{METRIC_PREFIX}/failure_rate": (counts["error"] + counts["timeout"]) / size,
        }
        return RewardResult(scores, metrics, {"judge_score": list(scores)}, messages)
