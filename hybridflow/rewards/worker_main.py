"""The reward worker process: runs user scoring code away from the trainer.

    main([_, <socket fd>, <output cap in bytes>, <the trainer's sys.path as JSON>])

Started by rewards/worker_process.py (``python -c``, after setting sys.path). It answers requests on the socket (a
multiprocessing Connection):
    ("load", target)          -> ("loaded",) | ("load_error", message, fix)
    ("score", calls, timeout) -> ("scored", [(status, value, message)], output,
                                  output_bytes, dropped_bytes)

What the scoring code writes to file descriptors 1 and 2 goes into a pipe read here: the
first ``output cap`` bytes of each request come back with its answer, the rest is only
counted, so a reward that prints megabytes a call neither fills the log nor grows memory.
Descriptors 1 and 2 and ``sys.stdout``/``sys.stderr`` are restored before each request, so
a reward that closes them only loses its own output. Values come back as plain Python data
(numbers, strings, lists, dicts): an object of the user's class is an error here, never
unpickled by the trainer.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from hybridflow.rewards.worker_process import MAX_VALUE_BYTES

_MAX_DEPTH = 8


class OutputCapture:
    """File descriptors 1 and 2 into a pipe; ``collect()`` returns what was written since the
    last call: (text of at most ``cap_bytes``, bytes written, bytes dropped)."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        read_fd, self._write_fd = os.pipe()
        # written after each request's output: the reader knows it has read all of it
        self._marker = b"\0hybridflow-reward-output-" + os.urandom(8).hex().encode() + b"\0"
        self._lock = threading.Lock()
        self._seen_marker = threading.Semaphore(0)
        self._kept, self._written = bytearray(), 0
        threading.Thread(target=self._read, args=(read_fd,), daemon=True).start()
        self.restore()

    def restore(self) -> None:
        """Descriptors 1 and 2 to the pipe, and open Python streams on them."""
        os.dup2(self._write_fd, 1)
        os.dup2(self._write_fd, 2)
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name)
            if stream is None or getattr(stream, "closed", True) or _fileno(stream) != fd:
                setattr(sys, name, io.TextIOWrapper(open(fd, "wb", closefd=False),  # noqa: SIM115
                                                    errors="backslashreplace",
                                                    line_buffering=True))  # fmt: skip

    def collect(self, wait_s: float = 2.0) -> tuple[str, int, int]:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass  # closed or replaced by the reward: restore() reopens it
        os.write(self._write_fd, self._marker)
        self._seen_marker.acquire(timeout=wait_s)
        with self._lock:
            kept, written = bytes(self._kept), self._written
            self._kept, self._written = bytearray(), 0
        return kept.decode(errors="replace"), written, written - len(kept)

    def _take(self, data: bytes) -> None:
        with self._lock:
            self._written += len(data)
            room = self.cap_bytes - len(self._kept)
            if room > 0:
                self._kept += data[:room]

    def _read(self, read_fd: int) -> None:
        pending = b""
        while data := os.read(read_fd, 1 << 16):
            data = pending + data
            while (end := data.find(self._marker)) >= 0:
                self._take(data[:end])
                data = data[end + len(self._marker) :]
                self._seen_marker.release()
            # a marker may be split across reads: hold back a tail that begins one
            hold = next((n for n in range(len(self._marker) - 1, 0, -1)
                         if data.endswith(self._marker[:n])), 0)  # fmt: skip
            self._take(data[: len(data) - hold])
            pending = data[len(data) - hold :]


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def plain(value, depth: int = 0):
    """``value`` as numbers, strings, lists and dicts (numpy and torch values through
    ``tolist()``); TypeError for anything else."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    for kind in (int, float, str):  # a subclass (numpy's float64 is a float) as the plain kind:
        if isinstance(value, kind):  # the trainer unpickles no class
            return kind(value)
    if depth >= _MAX_DEPTH:
        raise TypeError(f"a value nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, dict):
        return {str(key): plain(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item, depth + 1) for item in value]
    if callable(getattr(value, "tolist", None)):  # numpy / torch scalars and arrays
        return plain(value.tolist(), depth + 1)
    raise TypeError(f"a {type(value).__name__}")


def sendable(outcome, target: str) -> tuple[str, object, str]:
    """(status, value, message) with a plain value of bounded size, or an error saying why
    the value cannot be one."""
    if outcome.status != "ok":
        return outcome.status, None, outcome.message
    try:
        value = plain(outcome.value)
        size = len(pickle.dumps(value))
    except Exception as error:  # TypeError, RecursionError, a failing tolist()
        return "error", None, (f"scorer {target} returned {error}; expected a finite number "
                               "or a dict with a 'score'")  # fmt: skip
    if size > MAX_VALUE_BYTES:
        return "error", None, (f"scorer {target} returned {size} bytes of data (more than "
                               "1 MiB); expected a finite number or a dict")  # fmt: skip
    return "ok", value, ""


def answer(request, capture: OutputCapture):
    from hybridflow.errors import UserError
    from hybridflow.rewards.custom import load_function
    from hybridflow.rewards.parallel import run_chunk

    capture.restore()
    if request[0] == "load":
        try:
            load_function(request[1])
            reply = ("loaded",)
        except UserError as error:
            reply = ("load_error", error.message, error.fix)
        capture.collect()  # what the import printed is not a request's output
        return reply
    _, calls, timeout_s = request
    outcomes = run_chunk(calls, timeout_s)
    outcomes = [sendable(outcome, spec.target) for outcome, (spec, _) in zip(outcomes, calls)]
    return ("scored", outcomes, *capture.collect())


def _exit_with_trainer(trainer_pid: int, poll_s: float = 1.0) -> None:
    """End this process once the trainer has ended, even while a scorer spins. (Not the
    kernel's parent-death signal: that fires when the trainer's thread that started this
    process ends, and scoring may run on a thread of its own.)"""
    while os.getppid() == trainer_pid:
        time.sleep(poll_s)
    os._exit(0)


def _ignore(signum, frame) -> None:
    pass


def main(argv: list[str]) -> None:
    connection = Connection(int(argv[1]))
    # The trainer decides when a worker ends (a job scheduler's SIGTERM to every process must
    # not fail the scores of the step the trainer finishes); a handler, unlike SIG_IGN, is
    # reset for the programs a scorer runs.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _ignore)
    threading.Thread(target=_exit_with_trainer, args=(os.getppid(),), daemon=True).start()
    capture = OutputCapture(int(argv[2]))
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            return  # the trainer closed the connection
        connection.send(answer(request, capture))
