"""A record of each scheduler step (Scheduler.step_log): what kind of step it was, the decode
rows and prompt tokens it computed against those it was given, the graphs it captured and
whether the host waited for it. For finding where a workload's steps go (bench agent
--step-table, benchmarks/agent_steps.py); off (None) unless asked for.

Kinds of step:
- "decode": a chunk of decode steps (graph replays on CUDA), nothing prefilled;
- "passes + decode": the same after prefill/extend passes of their own (max_prefill_tokens_per_step
  0: admission.py, continuation.py);
- "mixed static": one forward of the rows and prompt chunks with static shapes (static_step.py);
- "mixed eager": the same forward sized by the data (mixed.py, graph_mixed_steps off or the
  torch backend);
- "prefill": a mixed-path step with no row decoding (the chunks alone, eager);
- "verify": a speculative verify pass; "passes": passes with nothing decoded; "read-back": only
  the last chunk's results read.

Padded work is what the device computes: a decode chunk's rows at its graph's batch bucket
(graphs.batch_buckets: what a CUDA graph replays, recorded so on the CPU too), a static step's
rows and chunk tokens at their buckets; eager passes compute what they are given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.engine.scheduling.state import SchedulerState

KINDS = ("decode", "passes + decode", "mixed static", "mixed eager", "prefill", "verify",
         "passes", "read-back")  # fmt: skip


@dataclass(frozen=True)
class Counters:
    """The scheduler's running counters at one moment (a step's record is their change)."""

    decode_steps: int
    plain_decode_steps: int
    mixed_steps: int
    decoded_rows: int
    admissions: int
    prefill_tokens: int
    chunk_tokens: int
    static_steps: int
    captures: int
    drains: int
    clock: float


def counters(scheduler: SchedulerState) -> Counters:
    static = scheduler.static_step
    captures = scheduler.runner.captures + (static.captures if static is not None else 0)
    return Counters(
        scheduler.decode_steps, scheduler.plain_decode_steps, scheduler.mixed_steps,
        scheduler.decoded_rows, scheduler.admissions, scheduler.engine.prefill_tokens,
        scheduler.chunk_tokens, static.steps if static is not None else 0, captures,
        scheduler.drains, time.perf_counter(),
    )  # fmt: skip


@dataclass(frozen=True)
class StepRecord:
    """One scheduler step. rows/row_bucket: decode rows per forward, live and computed;
    tokens/token_bucket: prompt tokens (chunks or passes), given and computed."""

    kind: str
    forwards: int  # decode forwards (a chunk's steps; 1 for a mixed step)
    rows: int
    row_bucket: int
    tokens: int
    token_bucket: int
    first_tokens: int  # eager first-token samplings (a pass's or finished jobs')
    captures: int  # graphs captured during the step
    drains: int  # reads of the step's own results: the host waited for the device
    seconds: float  # the step's host wall time


def record(scheduler: SchedulerState, before: Counters) -> StepRecord:
    """The step since `before` (counters taken as it began)."""
    now = counters(scheduler)
    delta = Counters(*(b - a for a, b in zip(_values(before), _values(now))))
    forwards = delta.decode_steps
    rows = delta.decoded_rows // forwards if forwards else 0
    tokens = delta.chunk_tokens if scheduler.mixed else delta.prefill_tokens
    row_bucket, token_bucket = rows, tokens
    if delta.static_steps:
        kind = "mixed static"
        row_bucket, token_bucket = scheduler.static_step.shape
    elif delta.mixed_steps:
        kind = "mixed eager"
    elif delta.chunk_tokens:
        kind = "prefill"
    elif delta.plain_decode_steps:
        kind = "passes + decode" if delta.admissions else "decode"
        row_bucket = next(b for b in scheduler.runner.buckets if b >= rows)
    elif forwards:
        kind = "verify"
    else:
        kind = "passes" if delta.admissions else "read-back"
    return StepRecord(kind, forwards, rows, row_bucket, tokens, token_bucket, delta.admissions,
                      delta.captures, delta.drains, delta.clock)  # fmt: skip


def _values(c: Counters) -> list:
    return [getattr(c, f.name) for f in fields(c)]


@dataclass
class KindTotals:
    """Steps of one kind summed: forwards, row-forwards and tokens live and computed."""

    steps: int = 0
    forwards: int = 0
    rows: int = 0  # sum of rows x forwards
    row_work: int = 0  # sum of row_bucket x forwards
    tokens: int = 0
    token_work: int = 0
    first_tokens: int = 0
    captures: int = 0
    drains: int = 0
    seconds: float = 0.0


def summarize(steps: list[StepRecord]) -> dict[str, KindTotals]:
    """Totals per kind (in KINDS order, kinds that ran only)."""
    out = {kind: KindTotals() for kind in KINDS}
    for step in steps:
        t = out[step.kind]
        t.steps += 1
        t.forwards += step.forwards
        t.rows += step.rows * step.forwards
        t.row_work += step.row_bucket * step.forwards
        t.tokens += step.tokens
        t.token_work += step.token_bucket
        t.first_tokens += step.first_tokens
        t.captures += step.captures
        t.drains += step.drains
        t.seconds += step.seconds
    return {kind: t for kind, t in out.items() if t.steps}


def table(steps: list[StepRecord], layers: int, modeled: list[float] | None = None) -> str:
    """A markdown table of summarize(steps), with the total work in tokens x layers.
    modeled: each step's seconds on a modeled device (a column beside the host's)."""
    extra = ("", "") if modeled is None else (" modeled ms |", "---|")
    lines = ["| step kind | steps | decode forwards | row-forwards live / computed | prompt "
             "tokens given / computed | first-token samplings | captures | host waits | "
             "host ms |" + extra[0], "|---|---|---|---|---|---|---|---|---|" + extra[1]]  # fmt: skip
    per_kind = {}
    for step, seconds in zip(steps, modeled or [0.0] * len(steps)):
        per_kind[step.kind] = per_kind.get(step.kind, 0.0) + seconds
    total = KindTotals()
    for kind, t in summarize(steps).items():
        lines.append(_row(kind, t, None if modeled is None else per_kind[kind]))
        for f in fields(KindTotals):
            setattr(total, f.name, getattr(total, f.name) + getattr(t, f.name))
    lines.append(_row("all", total, None if modeled is None else sum(modeled)))
    live, work = total.rows + total.tokens, total.row_work + total.token_work
    lines.append(f"work in tokens x layers: live {live * layers:,}, computed {work * layers:,} "
                 f"({work / max(live, 1):.2f}x)")  # fmt: skip
    return "\n".join(lines)


def _row(kind: str, t: KindTotals, modeled: float | None) -> str:
    row = (f"| {kind} | {t.steps:,} | {t.forwards:,} | {t.rows:,} / {t.row_work:,} | "
           f"{t.tokens:,} / {t.token_work:,} | {t.first_tokens:,} | {t.captures} | {t.drains} | "
           f"{t.seconds * 1000:,.1f} |")  # fmt: skip
    return row if modeled is None else row + f" {modeled * 1000:,.1f} |"
