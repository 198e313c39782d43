"""Stopping on SIGTERM (a job scheduler's "time is up") or SIGINT (Ctrl-C) within seconds,
without losing the work done.

A phase with work worth saving declares what it does on a signal (:meth:`StopRequest.graceful`):
the RL loop finishes the step it is in and saves a checkpoint, a validation ends at its next
batch and the step's checkpoint is saved, the SFT warm start saves its progress after the
current SFT step. There the first signal only sets a flag that the phase reads between its
pieces of work; the phase then raises :meth:`StopRequest.stopped`, a message saying what was
saved and how to resume (exit status 128 + the signal: 143 for SIGTERM, 130 for SIGINT).

Anywhere else (checking the config, loading a model, a validation before the first step)
there is nothing to save, and the first signal stops at once. So does a second signal in any
phase, keeping what is already complete on disk.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from hybridflow.errors import RunStopped

SIGTERM_EXIT = 128 + signal.SIGTERM
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_at_once(signum: int) -> BaseException:
    """What a signal raises when it stops the process at once: SystemExit(143) for SIGTERM
    (finally blocks and atexit run), KeyboardInterrupt for SIGINT (as Ctrl-C always does)."""
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return SystemExit(128 + signum)


class StopRequest:
    """Set by the SIGTERM/SIGINT handler, read by the phases between their pieces of work."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._handler = None
        self._plan: str | None = None  # what the phase does on a first signal; None: stop now

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"

    def stopped(self, message: str) -> RunStopped:
        """The error that ends a phase which honoured the request: ``stopped by SIGTERM
        {message}``, with the exit status of the signal."""
        return RunStopped(f"stopped by {self.signal_name} {message}",
                          exit_code=128 + (self.signum or signal.SIGTERM))  # fmt: skip

    def reclaim(self) -> None:
        """Install the handler again: ``ray.init`` replaces SIGTERM's with its own (which exits)."""
        if self._handler is not None and threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._handler)

    @contextlib.contextmanager
    def graceful(self, plan: str) -> Iterator[StopRequest]:
        """Within the block a first signal sets :attr:`requested` and says ``plan`` (what
        the phase will do: "finishing this step, then saving a checkpoint and stopping");
        the phase must then stop soon with :meth:`stopped`. Blocks nest: the innermost
        plan is said."""
        outer, self._plan = self._plan, plan
        try:
            yield self
        finally:
            self._plan = outer

    @contextlib.contextmanager
    def on_signals(self, log: Callable[[str], None]) -> Iterator[StopRequest]:
        """Within the block, SIGTERM and SIGINT go through this request (see the module's
        docstring) instead of their usual handlers."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handle(signum, frame) -> None:
            name = signal.Signals(signum).name
            if self.requested:
                log(f"{name} again: stopping now")
                raise stop_at_once(signum)
            if self._plan is None:
                log(f"{name}: stopping now (nothing to save at this point)")
                raise stop_at_once(signum)
            self.requested, self.signum = True, signum
            log(f"{name}: {self._plan} (a second {name} stops at once)")

        self._handler = handle
        previous = {signum: signal.signal(signum, handle) for signum in STOP_SIGNALS}
        try:
            yield self
        finally:
            self._handler = None
            for signum, handler in previous.items():
                signal.signal(signum, handler)
