"""Progress of long work: a rich bar on a terminal, a status line every ~10 s elsewhere.

Each phase that can take more than a few seconds (validation, a step's stages, the SFT warm
start, checkpoint save and load) opens a task on the run's :class:`ProgressReporter`:

    with progress.task("validation", total=len(dataset), unit="prompts") as task:
        for batch in batches:
            ...
            task.advance(len(batch))

On a terminal the open tasks are rich progress bars and everything printed (the step table)
goes above them. Elsewhere (log files, CI) nothing animates: once nothing has been printed
for ``interval_s`` (or for twice the time the task's last step took, if longer), one line
says where the innermost task is, e.g.
``validation: 512/1319 prompts (39%), 1m10s elapsed, ~1m50s left``. A log then shows that
work goes on without the table drowning in status lines.

Python warnings raised while a run is being reported (libraries warn on first use) are
collected, once each, and printed by the step table before its next row, under a fresh
header: never between two rows, and never as the two-line ``warnings`` format whose second
line (``return func(*args, **kwargs)``) means nothing to a reader.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_INTERVAL_S = 10.0


def format_duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h07m``: short enough for a status line."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


@dataclass
class TaskProgress:
    """One phase being reported: ``advance`` what it has done, ``set_status`` what it does."""

    description: str
    total: float | None
    unit: str
    started: float
    done: float = 0.0
    status: str = ""
    """What the phase is doing right now (a step's stage); shown after the description."""
    lines: int = 0
    """Status lines printed for it (non-terminal output)."""
    advanced_at: float | None = None
    """When ``done`` last changed (the reporter's clock)."""
    advance_gap: float = 0.0
    """Seconds between the last two changes of ``done``: how long one unit (a step) takes."""
    rows: bool = False
    """Each unit done is reported by a line of its own (a step's table row)."""
    start_done: float = 0.0
    """``done`` when this run took the task up (a resumed run's first step is after it)."""
    stopped: bool = False
    """The phase ended before its work was done (a stop request, an error): set by its owner
    where the total cannot tell (no total), and on an exception out of :meth:`task`."""
    reporter: ProgressReporter | None = field(default=None, repr=False)
    rich_id: Any = field(default=None, repr=False)

    def advance(self, amount: float = 1.0) -> None:
        self.update(self.done + amount)

    def update(self, done: float, status: str | None = None) -> None:
        if done != self.done and self.reporter is not None:
            now = self.reporter.clock()
            self.advance_gap = now - (
                self.started if self.advanced_at is None else self.advanced_at
            )
            self.advanced_at = now
        self.done = done
        if status is not None:
            self.status = status
        if self.reporter is not None:
            self.reporter.refresh(self)

    def set_status(self, status: str) -> None:
        self.update(self.done, status)


def closing_line(task: TaskProgress, took: str) -> str:
    """What a reported task says when it closes: done, or stopped where it was (short of its
    total, or :attr:`~TaskProgress.stopped`); the units of a resumed task are this run's,
    with where it started and ended."""
    unit = f" {task.unit}" if task.unit else ""
    of_total = f" of {task.total:g}" if task.total else ""
    if task.stopped or (task.total and task.done < task.total):
        return f"{task.description}: stopped at {task.done:g}{of_total}{unit} after {took}"
    if not task.unit:
        return f"{task.description}: done in {took}"
    if task.start_done:
        this_run = task.done - task.start_done
        return (f"{task.description}: done, {this_run:g}{unit} in {took} (this run: "
                f"{task.start_done + 1:g} to {task.done:g}{of_total})")  # fmt: skip
    return f"{task.description}: done, {task.done:g}{unit} in {took}"


def progress_line(task: TaskProgress, now: float) -> str:
    """The non-terminal status line of ``task`` at time ``now`` (same clock as its start)."""
    elapsed = now - task.started
    name = f"{task.description} ({task.status})" if task.status else task.description
    parts = []
    if task.total:
        percent = 100.0 * task.done / task.total
        parts.append(f"{task.done:g}/{task.total:g} {task.unit} ({percent:.0f}%)")
    elif task.done:
        parts.append(f"{task.done:g} {task.unit}".rstrip())
    parts.append(f"{format_duration(elapsed)} elapsed")
    if task.total and 0 < task.done < task.total:
        parts.append(f"~{format_duration(elapsed * (task.total - task.done) / task.done)} left")
    return f"{name}: {', '.join(parts)}"


HIDDEN_WARNINGS = (
    # torch.distributed.checkpoint says this on every save and load of a one-process run, even
    # when told no_dist=True: it is how such a run is meant to save, not a problem
    r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to",
)
"""Regular expressions (matched at the start of a warning's message) of library warnings a
reported run does not print: ones that are true of every such run and ask nothing of the user."""


class WarningCollector:
    """Stands in for ``warnings.showwarning``: one line per distinct warning, kept until the
    step table (or the end of the run) prints it."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.pending: list[str] = []
        self.lock = threading.Lock()

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        where = "/".join(Path(str(filename)).parts[-2:])
        text = f"warning: {category.__name__}: {message} ({where}:{lineno})"
        with self.lock:
            if text not in self.seen:
                self.seen.add(text)
                self.pending.append(text)

    def take(self) -> list[str]:
        with self.lock:
            pending, self.pending = self.pending, []
        return pending


class ProgressReporter:
    """Where a run prints: status of its open tasks, the step table, collected warnings.

    Args:
        console: a ``rich.console.Console`` (default: stdout).
        live: draw bars (default: when ``console`` is a terminal); otherwise status lines.
        interval_s: seconds of silence before a status line (non-terminal output).
        tick_s: how often a background thread checks for silence; None: no thread, the
            lines come only from ``advance``/``update`` calls and ``tick()``.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        console=None,
        *,
        live: bool | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        tick_s: float | None = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from rich.console import Console

        self.console = console if console is not None else Console()
        self.live = self.console.is_terminal if live is None else live
        self.interval_s, self.tick_s, self.clock = interval_s, tick_s, clock
        self.tasks: list[TaskProgress] = []
        self.warnings = WarningCollector()
        self.last_output = clock()
        self._last_was_status = False
        self._lock = threading.RLock()
        self._bar = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- printing
    def print(self, text: str, style: str | None = None) -> None:
        """One line above the bars; never wrapped, whatever the console's width."""
        with self._lock:
            console = self._bar.console if self._bar is not None else self.console
            console.print(text, style=style, soft_wrap=True, highlight=False, markup=False)
            self.last_output = self.clock()
            self._last_was_status = False

    def flush_warnings(self) -> bool:
        """Print the warnings collected since the last call; True if there were any."""
        pending = self.warnings.take()
        for text in pending:
            self.print(text, style="yellow")
        return bool(pending)

    @contextmanager
    def collecting_warnings(self) -> Iterator[None]:
        """Route Python warnings to :attr:`warnings` while the block runs (process-wide: the
        in-process workers' threads too), less :data:`HIDDEN_WARNINGS`; the ones not yet printed
        are printed at the end, and the filters and handler are what they were before."""
        with warnings.catch_warnings():
            for pattern in HIDDEN_WARNINGS:
                warnings.filterwarnings("ignore", message=pattern)
            warnings.showwarning = self.warnings.showwarning
            try:
                yield
            finally:
                self.flush_warnings()

    # ---- tasks
    @contextmanager
    def task(
        self,
        description: str,
        total: float | None = None,
        unit: str = "",
        done: float = 0.0,
        rows: bool = False,
    ) -> Iterator[TaskProgress]:
        """A phase reported while the block runs; ``rows``: each unit done prints a line of
        its own (the step table), so status lines wait longer (:meth:`tick`)."""
        task = self.open_task(description, total, unit, done)
        task.rows = rows
        try:
            yield task
        except BaseException:
            task.stopped = True
            raise
        finally:
            self.close_task(task)

    def open_task(
        self, description: str, total: float | None = None, unit: str = "", done: float = 0.0
    ) -> TaskProgress:
        task = TaskProgress(description, total, unit, started=self.clock(), done=done,
                            start_done=done)  # fmt: skip
        with self._lock:
            self.tasks.append(task)
            if self.live:
                bar = self._live_bar()
                task.rich_id = bar.add_task(description, total=total, completed=done)
            else:
                self._start_ticker()
        task.reporter = self
        return task

    def close_task(self, task: TaskProgress) -> None:
        with self._lock:
            if task in self.tasks:
                self.tasks.remove(task)
            if self._bar is not None and task.rich_id is not None:
                self._bar.remove_task(task.rich_id)
                if not self.tasks:
                    self._bar.stop()
                    self._bar = None
            if task.lines and not self.live:  # it reported progress: say that it ended
                self.print(closing_line(task, format_duration(self.clock() - task.started)))
        task.reporter = None

    def set_status(self, status: str) -> None:
        """What the innermost open task is doing now (e.g. a step's stage)."""
        task = self._innermost()
        if task is not None:
            task.set_status(status)

    def set_done(self, done: float) -> None:
        """How far the innermost open task is; clears its status (e.g. a step finished)."""
        task = self._innermost()
        if task is not None:
            task.update(done, status="")

    def _innermost(self) -> TaskProgress | None:
        with self._lock:
            return self.tasks[-1] if self.tasks else None

    def refresh(self, task: TaskProgress) -> None:
        if self.live:
            with self._lock:
                if self._bar is not None and task.rich_id is not None:
                    name = (
                        f"{task.description} ({task.status})" if task.status else task.description
                    )
                    self._bar.update(task.rich_id, completed=task.done, description=name)
            return
        self.tick()

    def tick(self) -> None:
        """Non-terminal output: after a silence, a line for the innermost task. The silence is
        ``interval_s``; for a task whose every unit prints a row (``rows``: the training steps
        and their table), twice the time the last unit took if longer: steps of 30 s need no
        line between their rows, and a step that takes twice as long as the one before gets
        one (then one every ``interval_s``, as long as it lasts)."""
        with self._lock:
            now = self.clock()
            if self.live or not self.tasks:
                return
            task = self.tasks[-1]
            silence, since = self.interval_s, max(self.last_output, task.started)
            if task.rows and not self._last_was_status and task.advanced_at is not None:
                silence = max(silence, 2 * task.advance_gap)  # a row per unit says enough
                since = max(since, task.advanced_at)  # its row comes just after the advance
            if now - since < silence:
                return
            self.print(progress_line(task, now))
            self._last_was_status = True
            task.lines += 1

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
        self.flush_warnings()

    def _live_bar(self):
        if self._bar is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                SpinnerColumn(),
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
        return self._bar

    def _start_ticker(self) -> None:
        if self.tick_s is None or self._ticker is not None:
            return
        self._ticker = threading.Thread(target=self._tick_until_closed, daemon=True,
                                        name="hybridflow-progress")  # fmt: skip
        self._ticker.start()

    def _tick_until_closed(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.tick()


def quiet_reporter() -> ProgressReporter:
    """A reporter that prints nothing (benchmarks, library use)."""
    from rich.console import Console

    return ProgressReporter(Console(quiet=True), live=False, tick_s=None)
