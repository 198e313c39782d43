"""Making reward failures loud. A scorer that raises, times out or returns something that is
not a number scores 0 for that sample and training goes on — which must not be silent:

- each distinct error message is printed once, as soon as it first happens;
- what the scoring code printed (captured in its worker) is shown under the scorer's
  name, at most MAX_OUTPUT_CHARS in a run, with how much was dropped;
- a step where most samples failed is flagged with the failure count;
- every sample failing on ``patience`` consecutive training steps stops the run with the
  error (exit 2): the reward function is broken, and more steps would train on zeros.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.errors import UserError
from hybridflow.rewards.managers import RewardResult

FIX_RULE = (
    "fix the scoring function (reward.custom_fn, or the scorer of the data_source); "
    "it must return a finite number or a dict with a 'score'"
)
FIX_JUDGE = (
    "check the judge: its server (reward.judge.url) answers, its replies hold a score "
    "that reward.judge.score_pattern matches, reward.judge.timeout_s is long enough"
)
MOSTLY_FAILED = 0.5
"""Fraction of failed samples above which a step is flagged."""
MAX_DISTINCT_MESSAGES = 10
"""Distinct messages printed in a run; the rest are only counted in the metrics."""
MAX_OUTPUT_CHARS = 64 * 1024
"""The scoring code's printed output shown in a run; the rest is only counted."""


class RewardFailureMonitor:
    """Watches each scoring call's failures; ``observe`` raises UserError to stop the run."""

    def __init__(self, log: Callable[[str], None], patience: int = 3, *,
                 metric_prefix: str = "reward", what: str = "reward",
                 fix: str = FIX_RULE):  # fmt: skip
        """metric_prefix: where the result's counts are (``<prefix>/num_errors``); what: the
        part's name in the messages; fix: what the stop message tells the user to do."""
        self.log, self.patience = log, patience
        self.metric_prefix, self.what, self.fix = metric_prefix, what, fix
        self.printed: set[str] = set()
        self.failed_steps_in_a_row = 0
        self.output_chars_shown = 0

    def observe(self, result: RewardResult, step: int, *, training: bool = True) -> None:
        size = len(result.scores)
        failed = int(result.metrics.get(f"{self.metric_prefix}/num_errors", 0)) + int(
            result.metrics.get(f"{self.metric_prefix}/num_timeouts", 0)
        )
        for message in result.error_messages:
            if message not in self.printed and len(self.printed) < MAX_DISTINCT_MESSAGES:
                self.printed.add(message)
                self.log(f"{self.what} error (shown once): {message}")
        self._show_output(result)
        where = f"step {step}" if training else f"validation at step {step}"
        if size and failed > MOSTLY_FAILED * size:
            self.log(f"warning: {where}: the {self.what} failed on {failed} of {size} samples "
                     f"(they score 0); see the errors above")  # fmt: skip
        if not training:
            return
        self.failed_steps_in_a_row = (
            self.failed_steps_in_a_row + 1 if size and failed == size else 0
        )
        if self.failed_steps_in_a_row >= self.patience:
            first = result.error_messages[0] if result.error_messages else "no message"
            raise UserError(
                f"the {self.what} failed on every sample for {self.patience} steps in a row (up "
                f"to step {step}): {first}",
                self.fix,
            )

    def _show_output(self, result: RewardResult) -> None:
        dropped = int(result.metrics.get(f"{self.metric_prefix}/output_bytes_dropped", 0))
        notes = [
            (f"{self.what} output ({name}):", text.rstrip("\n")) for name, text in result.output
        ]
        if dropped:
            notes.append((f"{self.what} output: {dropped} more bytes dropped this step "
                          f"(counted in {self.metric_prefix}/output_bytes_dropped)", ""))  # fmt: skip
        for header, text in notes:
            room = MAX_OUTPUT_CHARS - self.output_chars_shown
            if room <= 0:
                return
            shown = text[:room]
            self.output_chars_shown += len(header) + len(shown)
            self.log(f"{header}\n{shown}" if shown else header)
            if self.output_chars_shown >= MAX_OUTPUT_CHARS:
                self.log(
                    f"{self.what} output: {MAX_OUTPUT_CHARS} characters shown in this run; "
                    f"the rest is not printed (counted in {self.metric_prefix}/output_bytes)"
                )
