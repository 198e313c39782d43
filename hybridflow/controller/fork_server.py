"""The fork server that local-backend workers start from: multiprocessing's ``forkserver``, a
fresh interpreter that imports :data:`WORKER_PRELOAD` once, then forks one child per worker, so
that no worker pays for importing torch and its distributed modules again (~2-3 s of CPU each).

Why forking after these imports is safe: the server imports modules and runs nothing else.
Importing torch does not initialise CUDA (torch.cuda initialises lazily, at a worker's first
``set_device``), so each child starts CUDA for itself as a spawned process would; and the
server runs no Python thread, so no child inherits a lock that another thread held (the one
native thread, numpy's OpenBLAS pool, is stopped before each fork by OpenBLAS's own fork
handler and started again when next needed). tests/controller/test_fork_server.py checks both
facts on the preload list.

What the server does not carry over, the local backend passes to each worker: the caller's
environment at the time the worker starts (the server kept the one of its own start). A module
that reads a setting at import is therefore left out of the preload, for each worker to import
after taking that environment; torch reads a few logging and debug switches at import (such as
TORCH_LOGS): a process that changes them after its first group started keeps the first ones in
later workers."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

WORKER_PRELOAD = [
    __name__,  # first: the server ignores SIGTERM from then on (see below)
    "torch",
    "torch.distributed.tensor",  # brings sympy: the largest part after torch itself
    "torch.distributed.fsdp",
    "hybridflow.models",
]

if sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules:
    # Running inside the fork server (its command line is `python -c "from
    # multiprocessing.forkserver import main; ..."`). A scheduler's SIGTERM to every process of
    # a job must not kill it: its workers ignore SIGTERM while the controller saves a
    # checkpoint, and the controller reads a dead server as dead workers. The server still
    # exits with its controller (it reads EOF from the controller's "alive" pipe). Its children
    # start with the default, as spawned ones would (a worker ignores SIGTERM by itself).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def process_context():
    """The multiprocessing context local-backend workers start in: the fork server where the
    platform has one, else ``spawn`` (a fresh interpreter per worker)."""
    import torch.multiprocessing as mp

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts (once)
    return context


def apply_environment(environ: dict[str, str]) -> None:
    """Make this process's environment ``environ`` (the controller's when it started this
    worker), before anything reads it."""
    os.environ.clear()
    os.environ.update(environ)
