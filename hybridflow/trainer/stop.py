"""Stopping on SIGTERM (a job scheduler's "time is up") without losing the work done.

The first SIGTERM sets a flag: the loop finishes the step it is in, saves a checkpoint and
stops with a message that says how to resume (exit status 143). A second SIGTERM stops at
once, keeping the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

SIGTERM_EXIT = 128 + signal.SIGTERM


class StopRequest:
    """Set by the SIGTERM handler, read by the loop between steps."""

    def __init__(self) -> None:
        self.requested = False
        self._handler = None

    def reclaim(self) -> None:
        """Install the handler again: ``ray.init`` replaces it with its own (which exits)."""
        if self._handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handler)

    @contextlib.contextmanager
    def on_sigterm(self, log: Callable[[str], None]) -> Iterator[StopRequest]:
        """Within the block, SIGTERM requests a stop instead of killing the process."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handle(signum, frame) -> None:
            if self.requested:
                raise SystemExit(SIGTERM_EXIT)
            self.requested = True
            log("SIGTERM: finishing this step, then saving a checkpoint and stopping "
                "(a second SIGTERM stops at once)")  # fmt: skip

        self._handler = handle
        previous = signal.signal(signal.SIGTERM, handle)
        try:
            yield self
        finally:
            self._handler = None
            signal.signal(signal.SIGTERM, previous)
