"""The long tail of a generation: the scheduler steps while at most a few rows decode
(EngineOptions.speculative_max_rows, where verify passes run) and no prompt is prefilled.
There a step reads every weight for a few rows' tokens, so the tail's seconds are most of a
long-response step's generation time.

The clock counts the tail's wall time and its plain decode steps, with speculation on or
off; with speculation on, the verify passes' own seconds and tokens (verify.SpeculationStats)
give what they saved: the decode steps the passes' tokens would have taken at the tail's
measured seconds per plain decode step, less the passes' seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

TAIL_METRICS = "tail_metrics"
"""Batch.meta key of a rollout's tail metrics (tail_metrics below)."""


@dataclass
class TailStats:
    """Counters since the engine was made (rollout metrics read their differences)."""

    steps: int = 0  # scheduler steps taken in the tail
    seconds: float = 0.0  # their wall time (verify passes included)
    decode_steps: int = 0  # plain decode steps queued by them (verify passes not counted)

    def since(self, earlier: TailStats) -> TailStats:
        """The counts of what ran after `earlier` (a copy taken then: dataclasses.replace)."""
        return TailStats(*(getattr(self, f.name) - getattr(earlier, f.name)
                           for f in fields(self)))  # fmt: skip


def in_tail(rows: int, prefilling: bool, tail_rows: int) -> bool:
    """Whether a step with `rows` decoding rows (after its admission) is in the tail."""
    return 0 < rows <= tail_rows and not prefilling


def decode_step_seconds(total: TailStats, pass_seconds: float) -> float | None:
    """Seconds per plain decode step in the tail, over the engine's life: the tail's wall
    time outside verify passes (pass_seconds, their total) per plain decode step; None while
    no plain decode step has run in a tail."""
    if total.decode_steps <= 0:
        return None
    return max(total.seconds - pass_seconds, 0.0) / total.decode_steps


def seconds_saved(passes: int, rows: int, emitted: int, pass_seconds: float,
                  step_seconds: float) -> float:  # fmt: skip
    """Tail seconds verify passes saved: a pass emits emitted / rows tokens a row, so the
    `passes` passes stand for passes * emitted / rows plain decode steps of step_seconds
    each; less the passes' own seconds. Negative when they cost more than they saved."""
    if passes <= 0 or rows <= 0:
        return 0.0
    return passes * emitted / rows * step_seconds - pass_seconds


def tail_metrics(call: TailStats, total: TailStats, speculation=None) -> dict[str, float]:
    """Rollout metrics of one call: its tail's seconds and plain decode steps; with
    speculation (a pair of verify.SpeculationStats: the call's, the engine's life's), the
    tail seconds its passes saved, once a plain decode step in a tail has been timed."""
    metrics = {"rollout/tail_seconds": call.seconds,
               "rollout/tail_decode_steps": float(call.decode_steps)}  # fmt: skip
    if speculation is None:
        return metrics
    spec_call, spec_total = speculation
    step_seconds = decode_step_seconds(total, spec_total.seconds)
    if step_seconds is not None:
        metrics["rollout/speculative_tail_seconds_saved"] = seconds_saved(
            spec_call.passes, spec_call.rows, spec_call.emitted, spec_call.seconds, step_seconds
        )
    return metrics
