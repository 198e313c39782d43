"""controller/fork_server.py: local-backend workers fork from multiprocessing's fork server,
which has imported torch once; each takes its controller's environment of the moment it
starts, the server survives a SIGTERM to every process of a job, and its preload starts no
thread and no CUDA (what makes forking after it safe). That a worker still exits with its
controller, which is no longer its parent: test_local_lifecycle.py."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
from toy_workers import Toy

from hybridflow.controller import ResourcePool, WorkerGroup
from hybridflow.controller.fork_server import process_context


def ignores(pid: int, signum: int) -> bool:
    with open(f"/proc/{pid}/status") as status:
        mask = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
    return bool(mask >> (signum - 1) & 1)


def test_workers_fork_from_the_server_with_the_environment_of_their_start(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_TEST_SETTING", "before")
    with WorkerGroup(Toy, ResourcePool(cpus=1), "local") as group:
        server = psutil.Process(group.pid()[0]).parent()
        assert "multiprocessing.forkserver" in " ".join(server.cmdline())
        assert ignores(server.pid, signal.SIGTERM)
        assert group.getenv("HYBRIDFLOW_TEST_SETTING") == ["before"]
    # The server, already running, keeps the environment of its own start.
    monkeypatch.setenv("HYBRIDFLOW_TEST_SETTING", "after")
    with WorkerGroup(Toy, ResourcePool(cpus=1), "local") as group:
        assert psutil.Process(group.pid()[0]).parent().pid == server.pid
        assert group.getenv("HYBRIDFLOW_TEST_SETTING") == ["after"]


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)


def test_other_children_of_the_server_keep_the_default_sigterm():
    """E.g. test ranks, or any process of the controller's that starts from the fork server."""
    process = process_context().Process(target=_terminate_self)
    process.start()
    process.join(30)
    assert process.exitcode == -signal.SIGTERM


def test_a_platform_without_a_fork_server_spawns_the_workers(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["fork", "spawn"])
    assert process_context().get_start_method() == "spawn"


PRELOAD_PROBE = """
    import importlib, signal, threading
    from hybridflow.controller.fork_server import WORKER_PRELOAD
    for name in WORKER_PRELOAD:
        importlib.import_module(name)
    import torch
    print(threading.active_count(), torch.cuda.is_initialized(),
          signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
"""


def test_the_preload_starts_no_thread_nor_cuda_and_keeps_sigterm_outside_the_server():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(PRELOAD_PROBE)],
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert out.stdout.split() == ["1", "False", "True"], out.stderr
