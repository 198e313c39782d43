"""The errors a user can act on, and the one place that turns any exception into what
the command line prints.

Every loader and check raises :class:`UserError` (or a subclass: ``ConfigError``,
``DataSchemaError``, ``CustomRewardError``…) with a message that names the file, key, row or
line, and the fix. ``hybridflow`` prints it in one paragraph and exits with status 2. A few
environment failures raised by libraries are recognised here too (a full disk, a read-only
directory, a missing package, CUDA out of memory). Anything else is a bug: its traceback is
shown with a line saying so. ``hybridflow --debug`` shows every traceback.

This module imports nothing heavy (no torch): the config package and the CLI use it.
"""

from __future__ import annotations

import errno
import os
import shutil
import traceback
from collections.abc import Iterator

BUG_EXIT_CODE = 1
USER_EXIT_CODE = 2


class UserError(Exception):
    """A problem with the user's input or environment; ``fix`` says what to change.

    ``str()`` is the message followed by the fix, which is what the user sees."""

    exit_code = USER_EXIT_CODE

    def __init__(self, message: str, fix: str | None = None):
        self.message, self.fix = message, fix
        super().__init__(message if not fix else f"{message}: {fix}")


class RunStopped(UserError):
    """The run was asked to stop (SIGTERM, SIGINT); the message says what was saved and how
    to resume. Printed as it is (a stop asked for is no error), with the exit status 128 + the
    signal number, as a shell reports a killed process."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception it was raised from or while handling."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


WRITE_FAILED = ("file write failed", "inline_container")
"""How torch.save reports a failed write (no errno): a full disk when space is short."""

LOW_SPACE_BYTES = 64 * 2**20


def is_disk_full(error: BaseException, path: str | os.PathLike | None = None) -> bool:
    """ENOSPC anywhere in the chain, or torch's "file write failed" while ``path``'s file
    system has almost no space left."""
    for cause in causes(error):
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(cause)
        if "No space left on device" in text:
            return True
        if path is not None and any(marker in text for marker in WRITE_FAILED):
            try:
                return shutil.disk_usage(path).free < LOW_SPACE_BYTES
            except OSError:
                return False
    return False


_MEMORY_FIELDS = (  # (label, pattern) in torch's CUDA out-of-memory message
    ("tried to allocate", r"Tried to allocate ([\d.]+ [KMGT]?i?B)"),
    ("in use by this process", r"this process has ([\d.]+ [KMGT]?i?B) memory in use"),
    ("allocated by PyTorch", r"([\d.]+ [KMGT]?i?B) is allocated by PyTorch"),
    ("free", r"of which ([\d.]+ [KMGT]?i?B) is free"),
    ("total", r"total capacity of ([\d.]+ [KMGT]?i?B)"),
)


def format_oom(message: str, *, stage: str | None = None, rank: int | None = None) -> str:
    """One paragraph for a CUDA out-of-memory: the stage and rank, the memory figures torch
    reports (``message`` is its text), and what to change."""
    import re

    gpu = re.search(r"GPU (\d+)", message)
    where = [f"in {stage}" if stage else "", f"on rank {rank}" if rank is not None else "",
             f"(GPU {gpu.group(1)})" if gpu else ""]  # fmt: skip
    figures = [
        f"{label} {found.group(1)}"
        for label, pattern in _MEMORY_FIELDS
        if (found := re.search(pattern, message))
    ]
    location = " ".join(w for w in where if w)
    memory = f": {', '.join(figures)}" if figures else ""
    return (
        f"CUDA out of memory{' ' + location if location else ''}{memory}. To fit, lower "
        "actor.micro_batch_size_per_gpu or actor.max_tokens_per_gpu (training), "
        "actor.log_prob_max_tokens_per_gpu or ref.max_tokens_per_gpu (log-prob stages), "
        "rollout.gpu_memory_utilization or data.max_response_length (generation), "
        "set model.gradient_checkpointing=true, or spread the model over more GPUs "
        "(trainer.n_gpus_per_node)"
    )


def _is_oom(text: str) -> bool:
    """torch's CUDA out-of-memory, from its text (also as a worker reports it)."""
    return text.startswith("OutOfMemoryError") or "CUDA out of memory" in text


HOST_OOM = "DefaultCPUAllocator: can't allocate memory"
"""How torch reports a host allocation the system refused (too large for its memory)."""


def format_host_oom(message: str, *, stage: str | None = None, rank: int | None = None) -> str:
    """One paragraph for a refused host allocation: where, its size (from torch's text
    ``message``), and what to change (on CPU the rollout cache and the batches live here)."""
    import re

    where = " ".join(part for part in (f"in {stage}" if stage else "",
                                       f"on rank {rank}" if rank is not None else "") if part)  # fmt: skip
    size = re.search(r"allocate (\d+) bytes", message)
    tried = f": tried to allocate {int(size.group(1)) / 2**30:,.1f} GiB" if size else ""
    return (
        f"out of host memory{' ' + where if where else ''}{tried}. To fit, lower "
        "rollout.max_num_seqs (a CPU rollout's cache holds that many sequences), "
        "data.max_prompt_length + data.max_response_length, data.train_batch_size or "
        "actor.micro_batch_size_per_gpu; `hybridflow config plan` shows each item's memory"
    )


def as_user_error(error: BaseException) -> UserError | None:
    """The :class:`UserError` ``error`` is or stands for; None when it is a bug."""
    for cause in causes(error):
        if isinstance(cause, UserError):
            return cause
        if getattr(cause, "user_error", False):  # a UserError raised in a worker (WorkerError)
            return UserError(f"{_without_type(cause.error)} (group {cause.group!r}, "
                             f"rank {cause.rank}, in {cause.method})")  # fmt: skip
        if hasattr(cause, "method") and _is_oom(str(getattr(cause, "error", ""))):  # a worker's
            return UserError(format_oom(cause.error, stage=cause.method, rank=cause.rank))
        if hasattr(cause, "method") and HOST_OOM in str(getattr(cause, "error", "")):
            return UserError(format_host_oom(cause.error, stage=cause.method, rank=cause.rank))
    if is_disk_full(error):
        path = next((c.filename for c in causes(error) if getattr(c, "filename", None)), None)
        return UserError(
            f"no space left on the device{f' at {path}' if path else ''}",
            "free some space (or point trainer.run_dir / trainer.cache_dir elsewhere) and rerun",
        )
    for cause in causes(error):
        if isinstance(cause, PermissionError):
            return UserError(
                f"permission denied: {cause.filename or cause}",
                "make the path writable or choose another directory (trainer.run_dir)",
            )
        if type(cause).__name__ == "OutOfMemoryError" or _is_oom(str(cause)):  # in this process
            return UserError(format_oom(str(cause)))
        if HOST_OOM in str(cause):
            return UserError(format_host_oom(str(cause)))
    return None


def _without_type(error: str) -> str:
    """``"DataSchemaError: x.jsonl: line 3 …"`` -> ``"x.jsonl: line 3 …"``."""
    name, _, rest = error.partition(": ")
    return rest if rest and name.isidentifier() else error


def report(error: BaseException, *, debug: bool, program: str = "hybridflow") -> tuple[str, int]:
    """What the command line prints for ``error``, and its exit status."""
    user_error = as_user_error(error)
    shown = ""
    if debug or user_error is None:
        shown = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    if isinstance(user_error, RunStopped):  # asked for, not a failure: "stopped by SIGINT ..."
        return f"{shown}{user_error}", user_error.exit_code
    if user_error is not None:
        return f"{shown}error: {user_error}", user_error.exit_code
    return (
        f"{shown}internal error: {type(error).__name__}: {error}\n"
        f"This is a bug in {program}, not a problem with your input: please report it with "
        "the traceback above.",
        BUG_EXIT_CODE,
    )
