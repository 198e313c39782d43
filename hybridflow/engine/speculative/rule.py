"""When a tail step verifies drafts instead of decoding (EngineOptions.speculative_rule
"measured"): while a verify pass pays for itself, as the engine measures it in the tail.

A verify pass costs more than a plain decode step (k + 1 positions a row, eager, and a host
sync) and emits `tokens` a row: 1 plus its accepted drafts. It pays while

    tokens x (seconds of a plain decode step) > (1 + margin) x (seconds of a pass),

the three measured in the tail (scheduling/tail.py's steps): a plain decode step's seconds
per decode step, a pass's seconds (the scheduler step that ran it, less the wait for the
chunk queued before it, which is the decode steps'), and the tokens a row emits per pass.
Each is a decayed average (DECAY), so the rule follows a tail whose acceptance changes (a
row leaves, a draft source runs dry).

What is not running is not measured, so the rule re-probes the other kind every
`probe_steps` tail steps: while speculation is off, one verify pass; while it is on, one
plain decode step. Before both kinds were measured it tries the one missing (a pass first).
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8
"""Weight of the earlier measurements of a kind at each new one (about the last five
count): a verify pass's tokens vary with its rows' drafts, a decode step's seconds with the
rows left."""


def pays(tokens_per_row: float, step_seconds: float, pass_seconds: float, margin: float) -> bool:
    """Whether a verify pass emitting `tokens_per_row` tokens a row saves time over plain
    decode steps of step_seconds each, by more than `margin` of its own seconds."""
    return tokens_per_row * step_seconds > (1.0 + margin) * pass_seconds


def choose(estimates: tuple, margin: float, since_probe: int, probe_steps: int) -> tuple:
    """The next tail step's kind. estimates: (tokens a row emits per pass, seconds of a
    plain decode step, seconds of a pass), None where not measured yet; since_probe: tail
    steps of the preferred kind since the last probe. -> (verify: bool, probe: bool), probe
    when the step is not the preferred kind but a measurement of the other one."""
    tokens, step_seconds, pass_seconds = estimates
    if tokens is None or pass_seconds is None:
        return True, True
    if step_seconds is None:
        return False, True
    preferred = pays(tokens, step_seconds, pass_seconds, margin)
    if since_probe >= probe_steps:
        return not preferred, True
    return preferred, False


@dataclass
class Measured:
    """Decayed sums of the tail's measurements (their ratios are the estimates)."""

    decode_seconds: float = 0.0
    decode_steps: float = 0.0
    pass_seconds: float = 0.0
    passes: float = 0.0
    rows: float = 0.0
    emitted: float = 0.0

    def estimates(self) -> tuple:
        """(tokens a row emits per pass, seconds per plain decode step, seconds per pass),
        None for a kind not measured yet."""
        tokens = self.emitted / self.rows if self.rows > 0 else None
        step = self.decode_seconds / self.decode_steps if self.decode_steps > 0 else None
        per_pass = self.pass_seconds / self.passes if self.passes > 0 else None
        return tokens, step, per_pass

    def add_decode(self, seconds: float, steps: int) -> None:
        self.decode_seconds = DECAY * self.decode_seconds + seconds
        self.decode_steps = DECAY * self.decode_steps + steps

    def add_pass(self, seconds: float, passes: int, rows: int, emitted: int) -> None:
        self.pass_seconds = DECAY * self.pass_seconds + seconds
        self.passes = DECAY * self.passes + passes
        self.rows = DECAY * self.rows + rows
        self.emitted = DECAY * self.emitted + emitted


class SpeculationRule:
    """The engine's rule (module docstring) and its measurements, across its calls. The
    scheduler brackets each tail step with step_started / step_ended; verify.run_step asks
    verify_next() and reports the wait for the previous chunk (flushed)."""

    def __init__(self, measured: bool, margin: float, probe_steps: int):
        self.measured, self.margin, self.probe_steps = measured, margin, probe_steps
        self.timings = Measured()
        self.since_probe = 0  # steps of the preferred kind since the last probe or change
        self.preferred: bool | None = None  # whether the measurements favour verifying
        self.probing = False  # this step is a probe (a decode probe runs a single step)
        self.decided_off = False  # this step decodes because the rule said so
        self.last_verified: bool | None = None  # the kind of the last tail step measured
        self._flush = 0.0
        self._counts = (0, 0, 0)

    def verify_next(self) -> bool:
        """Whether this tail step verifies (asked once a step, when some row may draft)."""
        if not self.measured:
            return True
        verify, self.probing = choose(self.timings.estimates(), self.margin, self.since_probe,
                                      self.probe_steps)  # fmt: skip
        if self.probing:
            self.since_probe = 0
        elif verify == self.preferred:
            self.since_probe += 1
        else:  # the measurements changed sides: a new run of the preferred kind
            self.preferred, self.since_probe = verify, 1
        self.decided_off = not verify
        return verify

    def plain_steps(self, steps: int) -> int:
        """Decode steps to queue when the step decodes: one for a probe while speculation is
        on (it measures a step; a chunk would give up the passes' tokens)."""
        return 1 if self.decided_off and self.probing else steps

    def flushed(self, seconds: float) -> None:
        """A verify pass waited `seconds` for the tokens of the step before it: that step's
        kind's time."""
        self._flush = seconds
        if self.last_verified is True:
            self.timings.pass_seconds += seconds
        elif self.last_verified is False:
            self.timings.decode_seconds += seconds

    def step_started(self, stats) -> None:
        """A tail step begins (stats: the Speculation's counters)."""
        self._flush, self.probing, self.decided_off = 0.0, False, False
        self._counts = (stats.passes, stats.rows, stats.emitted)

    def step_ended(self, stats, seconds: float, plain_steps: int) -> None:
        """The tail step took `seconds` and queued `plain_steps` plain decode steps."""
        passes, rows, emitted = (now - before for now, before in
                                 zip((stats.passes, stats.rows, stats.emitted), self._counts))  # fmt: skip
        own = max(seconds - self._flush, 0.0)
        if passes:
            self.timings.add_pass(own, passes, rows, emitted)
            self.last_verified = True
        elif plain_steps:
            self.timings.add_decode(own, plain_steps)
            self.last_verified = False
            stats.off_steps += self.decided_off
