"""A fake clock and a reporter that writes like a log file, for the progress tests."""

import io

from rich.console import Console

from hybridflow.progress import ProgressReporter


class FakeClock:
    """Seconds that move only when told (or by ``step`` on every read)."""

    def __init__(self, step: float = 0.0):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def log_reporter(clock, interval_s=10.0):
    """A reporter writing to a non-terminal buffer, as in a log file (no bars)."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=60, force_terminal=False)
    return ProgressReporter(console, interval_s=interval_s, tick_s=None, clock=clock), buffer


def recording_reporter():
    """A log reporter whose every status check prints (its clock jumps 100 s a read, past
    the 30 s interval), and the descriptions of the tasks opened on it, in order."""
    reporter, buffer = log_reporter(FakeClock(step=100.0), interval_s=30.0)
    opened = []
    open_task = reporter.open_task

    def recording(description, *args, **kwargs):
        opened.append(description)
        return open_task(description, *args, **kwargs)

    reporter.open_task = recording
    return reporter, buffer, opened
