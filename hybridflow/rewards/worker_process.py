"""One reward worker process seen from the trainer (the process is rewards/worker_main.py):
start it, send it a request, read its answer, and say how it ended when it dies.

The worker is a child of the trainer in a session of its own (a Ctrl-C at the terminal
reaches the trainer only, which stops its workers); it ends within a second of the trainer. Its
answers are read with a size limit and unpickled as plain data only: whatever the scoring
code does to its process, the trainer gets an answer, or a `WorkerDied` naming what
happened.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

MAX_VALUE_BYTES = 1 << 20
"""A scorer's return, pickled, at most this size (a score is a number or a small dict)."""
_START = ("import json, sys; sys.path[:] = json.loads(sys.argv[3]); "
          "from hybridflow.rewards.worker_main import main; main(sys.argv)")  # fmt: skip


class WorkerDied(Exception):
    """The worker ended (or broke its connection) before answering; str() says how."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name} in an answer that must be plain data")


def plain_loads(data: bytes):
    """Unpickle numbers, strings, lists, tuples and dicts only (no class is looked up)."""
    return _PlainUnpickler(io.BytesIO(data)).load()


class RewardWorker:
    """A started worker process and its connection."""

    def __init__(self, output_cap_bytes: int):
        parent_end, child_end = socket.socketpair()
        fd = child_end.fileno()
        try:  # the trainer's import path: the worker runs this hybridflow and the reward
            # file imports what the trainer can
            self.process = subprocess.Popen(
                [sys.executable, "-c", _START, str(fd), str(output_cap_bytes), json.dumps(sys.path)],
                pass_fds=(fd,), stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        finally:
            child_end.close()
        self.connection = Connection(parent_end.detach())

    def send(self, request) -> None:
        try:
            self.connection.send(request)
        except (OSError, ValueError) as error:  # a broken pipe: it ended
            raise WorkerDied(self.how_it_ended()) from error

    def receive(self, max_bytes: int):
        """The next answer (blocks); WorkerDied if the worker ended or sent something that is
        not an answer (then it is killed)."""
        try:
            data = self.connection.recv_bytes(max_bytes)
        except (EOFError, OSError) as error:
            if self.process.poll() is None and not isinstance(error, EOFError):
                self.kill()
                raise WorkerDied(f"sent an answer larger than {max_bytes} bytes") from error
            raise WorkerDied(self.how_it_ended()) from error
        try:
            return plain_loads(data)
        except Exception as error:  # garbage on the connection: the scorer wrote to it
            self.kill()
            raise WorkerDied(f"sent an answer that cannot be read ({error})") from error

    def how_it_ended(self, wait_s: float = 5.0) -> str:
        """'exited with code N' or 'was killed by signal SIGX' (killing it after wait_s)."""
        try:
            code = self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return "stopped answering and was killed"
        if code < 0:
            try:
                return f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.connection.close()
        self._end_session()

    def close(self, wait_s: float = 5.0) -> None:
        """Closing the connection ends an idle worker; one that does not end is killed."""
        self.connection.close()
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._end_session()

    def _end_session(self) -> None:
        """Kill what the scoring code started in the worker's session (forked or spawned
        processes left running): they would outlive the run. The group keeps the worker's id
        while any of them lives, so no other process can hold it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # none left
