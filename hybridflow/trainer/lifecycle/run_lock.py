"""One process at a time in a run directory.

Two ``hybridflow train`` (or ``sft``) processes writing one run directory overwrite each
other's checkpoints and metrics. The first takes an exclusive ``flock`` on ``<dir>/LOCK``
for its whole life and writes who it is there (pid, host, command, start time); a second
one is refused at once, with exit status 2 and the first one named.

The kernel drops a flock when its process ends, however it ends (SIGKILL, a crash): a lock
left by a dead process is simply taken over, and the message says whose it was. The holder
empties the file whenever it exits through Python (an error, a stop), so leftover text
means a process that died.
(Over NFS, flock is only as good as the server's lock support.)

:func:`wait_for_turn` is the waiting kind, for work two runs may start at once (the same
warm start in a shared cache): the second waits for the first, then finds the work done.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hybridflow.errors import UserError

LOCK_FILE = "LOCK"


class RunDirBusy(UserError):
    """Another live process holds the run directory."""


def holder_text() -> str:
    """What this process writes into the lock file: who holds it, as one JSON line."""
    return json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        }
    )


def describe_holder(text: str) -> str:
    """``pid 123 on host h, started 2026-…, command: hybridflow train …`` from the file's text
    (what there is of it: a holder may have died before writing it all)."""
    try:
        holder = json.loads(text)
        return (f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}, "
                f"command: {holder['command']}")  # fmt: skip
    except (ValueError, KeyError, TypeError):
        return f"a process that left {text.strip()[:200]!r}" if text.strip() else "a process"


@contextlib.contextmanager
def hold_run_dir(directory: str | os.PathLike, key: str = "trainer.run_dir",
                 log: Callable[[str], None] = print) -> Iterator[Path]:  # fmt: skip
    """Hold ``directory`` (created if missing) for the block; :class:`RunDirBusy` when
    another live process holds it. ``key`` names the setting in the messages."""
    path = Path(directory).expanduser()
    created = _missing_dirs(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle = open(path / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115 - held below
    except (
        OSError
    ) as error:  # worded as the preflight check says it (trainer/lifecycle/preflight.py)
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        raise UserError(
            f"{key} = {directory}: cannot write in {existing} ({error.strerror or error})",
            "choose a writable directory",
        ) from None
    try:
        _take(handle, directory, key, log)
        try:
            yield path
        finally:  # any end Python sees: leftover text then always means a process that died
            handle.seek(0)
            handle.truncate()
            # a run refused before it wrote anything leaves no directory behind
            if created and [entry.name for entry in path.iterdir()] == [LOCK_FILE]:
                _remove_created(path, created)
    finally:
        handle.close()  # drops the flock


def _missing_dirs(path: Path) -> list[Path]:
    """The directories of ``path`` (deepest first) that do not exist yet."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_created(path: Path, created: list[Path]) -> None:
    """Remove the lock file and the (still empty) directories this process made for it."""
    with contextlib.suppress(OSError):
        (path / LOCK_FILE).unlink()
        for directory in created:
            directory.rmdir()


def _take(handle, directory, key: str, log: Callable[[str], None]) -> None:
    """flock ``handle`` and write this process into it; RunDirBusy when held elsewhere."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        raise RunDirBusy(
            f"{key} = {directory} is in use by another process "
            f"({describe_holder(handle.read())}); two runs in one directory would "
            f"overwrite each other's checkpoints and metrics",
            f"wait for that run to end (or stop it), or choose another {key}",
        ) from None
    handle.seek(0)
    left = handle.read()
    if left.strip():  # its holder died without emptying it (SIGKILL, a crash)
        log(f"{key} = {directory}: taking over the lock left by {describe_holder(left)}, "
            "which is no longer running")  # fmt: skip
    handle.seek(0)
    handle.truncate()
    handle.write(holder_text() + "\n")
    handle.flush()


@contextlib.contextmanager
def wait_for_turn(lock_file: Path, what: str, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold ``lock_file`` for the block, waiting for another process that holds it (saying
    so: "waiting for pid 123 …, which {what}"). For work two runs may start at once, such
    as the same warm start in a shared cache: the second waits, then finds it done."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            log(f"waiting for {describe_holder(handle.read())}, which {what}")
            fcntl.flock(handle, fcntl.LOCK_EX)  # a signal interrupts the wait as usual
        handle.seek(0)
        handle.truncate()
        handle.write(holder_text() + "\n")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
