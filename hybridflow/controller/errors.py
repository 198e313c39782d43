"""Errors the controller raises for failures that happened in workers."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker call raised. The message names the group, role, rank and method and carries
    the remote traceback (also in ``remote_traceback``)."""

    def __init__(
        self,
        group: str,
        role: str,
        rank: int,
        method: str,
        error: str,
        remote_traceback: str = "",
        user_error: bool = False,
    ) -> None:
        self.group, self.role, self.rank, self.method = group, role, rank, method
        self.error, self.remote_traceback = error, remote_traceback
        self.user_error = user_error  # a hybridflow UserError: errors.report shows it alone
        where = f"group {group!r}" + (f" role {role!r}" if role else "") + f" rank {rank}"
        message = f"{where} failed in {method}: {error}"
        if remote_traceback:
            message += "\n--- remote traceback ---\n" + remote_traceback.rstrip()
        super().__init__(message)

    def __reduce__(self):
        args = (self.group, self.role, self.rank, self.method, self.error, self.remote_traceback,
                self.user_error)  # fmt: skip
        return type(self), args


class WorkerDiedError(WorkerError):
    """A worker process (or Ray actor) is gone; the group has been shut down."""


class CallTimeoutError(TimeoutError):
    """A call did not finish within its timeout. The workers may still be running it."""
