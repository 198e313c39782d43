"""No worker process (nor anything a worker started) outlives a controller that is
interrupted (Ctrl-C), terminated (SIGTERM) or killed (SIGKILL: no cleanup code runs in
the controller; the workers notice their controller is gone, and so does the fork server they
came from)."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

CONTROLLER_SCRIPT = """
    import sys
    sys.path.insert(0, {tests_dir!r})
    from hybridflow.controller import ResourcePool, WorkerGroup
    from toy_workers import Toy

    if __name__ == "__main__":
        group = WorkerGroup(Toy, ResourcePool(cpus=1), "local")
        print(group.pids()[0], group.start_child()[0], flush=True)
        group.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def describe(pid: int) -> dict:
    try:
        return psutil.Process(pid).as_dict(["pid", "ppid", "status", "cmdline"])
    except psutil.NoSuchProcess:
        return {"pid": pid, "status": "gone"}


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_stopped_controller_leaves_no_orphans(tmp_path: Path, signum: int):
    script = tmp_path / "controller.py"
    tests_dir = str(Path(__file__).parent)
    script.write_text(textwrap.dedent(CONTROLLER_SCRIPT.format(tests_dir=tests_dir)))
    # Output goes to files, not pipes: the workers inherit them, and waiting on a pipe
    # would wait for the workers rather than check that they are gone.
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=stdout, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not out.read_text().endswith("\n") and time.monotonic() < deadline:
            assert proc.poll() is None, err.read_text()
            time.sleep(0.1)
        worker_pid, grandchild_pid = map(int, out.read_text().split())
        assert not gone(worker_pid) and not gone(grandchild_pid)
        server_pid = psutil.Process(worker_pid).ppid()  # the fork server the worker came from
        proc.send_signal(signum)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in err.read_text()
    if signum == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM  # SystemExit, so atexit ran
    survivors = [worker_pid, grandchild_pid, server_pid]
    assert wait_gone(survivors, timeout_s=15), [describe(p) for p in survivors if not gone(p)]
