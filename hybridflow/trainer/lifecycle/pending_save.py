"""A checkpoint being finished on a thread while training goes on (``trainer.async_save``).

At the save step the workers have copied their state to host memory and started writing it
(learners/state_writer.py), and the controller has captured its own small state. This thread
waits for the workers' files, writes the controller's, and publishes ``step_N`` through the
CheckpointManager (metadata, COMPLETE marker, rename, then pruning). Until then the checkpoint
is a ``.tmp-step_N`` that resuming ignores: a process killed meanwhile resumes from the
previous complete one. A failure removes the temporary directory and is raised by
:meth:`PendingSave.wait`, which the loop calls before the next save, at the end of the run
and on every error path, and as soon as the thread is found done after a step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from hybridflow.errors import UserError


class CheckpointWriteError(RuntimeError):
    """A checkpoint written in the background failed; the previous complete one is kept."""


class PendingSave:
    """Runs ``finish()`` (which returns the published ``step_N``) on a daemon thread.

    Args:
        step: the step being saved.
        temporary: its ``.tmp-step_N`` directory (named in the error message).
        finish: writes the rest and publishes; removes ``temporary`` when it fails.
        latest: the newest complete checkpoint, asked again when the write failed.
    """

    def __init__(
        self,
        step: int,
        temporary: Path,
        finish: Callable[[], Path],
        latest: Callable[[], Path | None],
    ) -> None:
        self.step, self.temporary = step, temporary
        self._finish, self._latest = finish, latest
        self._published: Path | None = None
        self._error: BaseException | None = None
        # A daemon: if the process exits without waiting (a second SIGTERM), the checkpoint
        # stays an ignored .tmp-step_N rather than holding the exit up.
        self._thread = threading.Thread(target=self._run, name=f"save-step_{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._published = self._finish()
        except BaseException as error:  # noqa: BLE001 - raised by wait() on the loop's thread
            self._error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until published; returns ``step_N`` or raises what went wrong."""
        self._thread.join()
        if self._error is None:
            return self._published
        if isinstance(self._error, UserError):  # a full disk: already says what to do
            raise self._error
        latest = self._latest()
        kept = f"{latest} is still the latest complete one" if latest else "none is complete"
        raise CheckpointWriteError(
            f"writing the checkpoint of step {self.step} in the background failed "
            f"({type(self._error).__name__}: {self._error}); its directory {self.temporary} "
            f"was removed and {kept}"
        ) from self._error
