"""No worker process (nor anything a worker started) outlives a controller that is
interrupted (Ctrl-C), terminated (SIGTERM) or killed (SIGKILL: no cleanup code runs in
the controller; the workers notice their parent is gone)."""

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
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        worker_pid, grandchild_pid = map(int, proc.stdout.readline().split())
        assert not gone(worker_pid) and not gone(grandchild_pid)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in stderr
    if signum == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM  # SystemExit, so atexit ran
    assert wait_gone([worker_pid, grandchild_pid], timeout_s=10)
