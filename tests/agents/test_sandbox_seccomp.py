"""A sandboxed program may not make namespaces (in one of its own it is uid 0 and can mount a
tmpfs that fills host memory past every limit), nor hold memory in memfds or SysV segments,
queues and semaphore sets;
fork, threads, subprocesses and multiprocessing still work."""

import os
import shutil
import sys

import pytest

if not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"):
    pytest.skip("the seccomp filter is built for Linux on x86_64 and aarch64",
                allow_module_level=True)  # fmt: skip

from hybridflow.agents.sandbox import SandboxLimits, jail_unavailable, run_code_sync

ATTEMPTS = r"""
import ctypes, os, shutil, subprocess, sys

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, SIGCHLD = 0x20000, 0x10000000, 17
CLONE = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
SHMGET_SIZE = 64 << 20


def outcome(name, result):
    errno = ctypes.get_errno()
    print(name, "refused" if result == -1 and errno == 1 else f"ALLOWED ({result}, {errno})")


if shutil.which("unshare"):  # what the attack used: uid 0 in a new user namespace, a tmpfs
    done = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs none /tmp && id -u"],
                          capture_output=True, text=True)
    print("unshare-cli", "refused" if done.returncode else f"ALLOWED ({done.stdout.strip()})")
else:
    print("unshare-cli refused (no unshare program here)")
if hasattr(os, "unshare"):  # Python 3.12
    try:
        os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNS)
        print("os.unshare ALLOWED")
    except PermissionError:
        print("os.unshare refused")
else:
    print("os.unshare", end=" ")
    outcome("", libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))
child = libc.syscall(CLONE, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
if child == 0:
    os._exit(0)  # the new process, where clone was allowed
outcome("clone-newuser", child)
if child > 0:
    os.waitpid(child, 0)
namespace = "/proc/self/ns/mnt"  # -1 where there is no /proc: EBADF unless refused first
outcome("setns", libc.setns(os.open(namespace, os.O_RDONLY) if os.path.exists(namespace) else -1, 0))
try:
    os.memfd_create("fill")
    print("memfd_create ALLOWED")
except PermissionError:
    print("memfd_create refused")
segment = libc.shmget(0, SHMGET_SIZE, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
outcome("shmget", segment)
if segment >= 0:
    libc.shmctl(segment, 0, None)  # IPC_RMID: where it was allowed, leave no segment behind
queue = libc.msgget(0, 0o1600)  # a SysV message queue, which outlives the program too
outcome("msgget", queue)
if queue >= 0:
    libc.msgctl(queue, 0, None)
semaphores = libc.semget(0, 8, 0o1600)
outcome("semget", semaphores)
if semaphores >= 0:
    libc.semctl(semaphores, 0, 0)

# what programs do: still allowed
import multiprocessing, threading
thread = threading.Thread(target=print, args=("thread ok",))
thread.start()
thread.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork ok" if os.waitpid(pid, 0)[1] >> 8 == 7 else "fork FAILED")
print(subprocess.run([sys.executable, "-c", "print('subprocess ok')"], capture_output=True,
                     text=True).stdout.strip())
with multiprocessing.Pool(2) as pool:
    print("pool ok" if pool.map(abs, [-1, -2]) == [1, 2] else "pool FAILED")
"""

REFUSED = [
    "unshare-cli",
    "os.unshare",
    "clone-newuser",
    "setns",
    "memfd_create",
    "shmget",
    "msgget",
    "semget",
]
STILL_WORKS = ["thread ok", "fork ok", "subprocess ok", "pool ok"]


@pytest.mark.parametrize("isolation", ["strict", "basic"])
def test_namespaces_memfds_and_shm_segments_are_refused(isolation):
    if isolation == "strict" and jail_unavailable():
        pytest.skip(f"this machine cannot build the sandbox's jail: {jail_unavailable()}")
    result = run_code_sync(ATTEMPTS, SandboxLimits(isolation=isolation, timeout_s=60))
    assert result.ok and result.isolation["isolation"] == isolation, result
    assert not result.isolation["unenforced"], result.isolation
    lines = result.stdout.splitlines()
    for name in REFUSED:
        line = next((line for line in lines if line.split()[0] == name), None)
        assert line is not None and line.split()[-1] == "refused", (name, result.stdout)
    for works in STILL_WORKS:
        assert works in lines, (works, result.stdout, result.stderr)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare program here")
def test_the_tmpfs_attack_writes_nothing_past_the_scratch_cap():
    """The attack as it was found: a tmpfs mounted in a new namespace took 1.5 GB of host
        memory past a 64 MiB scratch cap (in files under RLIMIT_FSIZE each). Here the namespace is
    refused, so nothing is mounted or written."""
    if jail_unavailable():
        pytest.skip(f"this machine cannot build the sandbox's jail: {jail_unavailable()}")
    attack = (
        "import subprocess\n"
        "script = ('mount -t tmpfs none /tmp && for i in 1 2 3 4 5 6 7 8; do "  # 8 x 10 MB
        "head -c 10000000 /dev/zero > /tmp/fill$i || exit 1; done && echo WROTE')\n"
        "done = subprocess.run(['unshare', '-Urm', 'sh', '-c', script], capture_output=True, "
        "text=True)\n"
        "print(done.returncode, done.stdout, done.stderr)\n"
    )
    result = run_code_sync(attack, SandboxLimits(isolation="strict", timeout_s=60))
    assert result.ok and "WROTE" not in result.stdout, result
    assert "Operation not permitted" in result.stdout, result
