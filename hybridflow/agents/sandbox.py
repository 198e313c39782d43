"""Running model-written Python in a separate process with limits, and the "python" tool.

Each program runs in a fresh interpreter (`sys.executable -I`, so the same packages are
importable and no PYTHON* variable applies) in its own session and process group, in an
empty temporary directory that is removed afterwards, with a minimal environment and
stdin at EOF unless input is given. What stops a program:

  wall clock    the parent kills the whole process group (SIGKILL) -> "timeout"
  CPU time      RLIMIT_CPU, SIGXCPU at `cpu_s` and SIGKILL a second later -> "cpu_limit"
  memory        RLIMIT_AS; allocations fail, Python raises MemoryError -> "memory_limit"
  file size     RLIMIT_FSIZE; a larger write fails with EFBIG -> "error"
  processes     RLIMIT_NPROC; fork and thread creation fail with EAGAIN
  output        each stream keeps `max_output_bytes`; past 4x that in total the group is
                killed -> "output_limit"
  network       an empty network namespace (no interfaces, not even loopback up)

When the program ends, whatever it left running dies with it: its process group, and
every process in the run's own network namespace (which finds those that left the group
with setsid). With `network=True`, or where no namespace could be made, a process that
left the group outlives the run, though not its CPU limit.

The limits are set by a small bootstrap that runs in the child interpreter and then execs
the program, rather than by a `preexec_fn`: a preexec_fn runs Python between fork and
exec, which can deadlock in a parent that has threads (a trainer has many), and it stops
`subprocess` from using vfork, so every run would copy the page tables of a possibly huge
parent.

Root ignores RLIMIT_NPROC and should not run model code anyway, so as root the bootstrap
drops to `nobody` (uid/gid 65534) after creating the namespaces. Where nobody cannot reach
the interpreter (a Python under /root, mode 0700), the bootstrap, in a private mount
namespace, covers each such directory with an empty tmpfs and binds back only the entries
the interpreter needs, so the rest stays hidden. Where privileges cannot be dropped, the
program runs anyway and its stderr starts with a "[sandbox] ..." line saying which limit
is not enforced. Without root, network isolation needs an unprivileged user namespace.
`sandbox_capabilities()` reports what this machine provides.

RLIMIT_NPROC counts every process and thread of a user, not of one program, so the
bootstrap sets it to the user's current count plus `max_processes` (in a fresh user
namespace the count starts at zero and the limit is `max_processes` itself). Programs
running at the same time as one user share that headroom.

Linux only: rlimits, namespaces and /proc as Linux has them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import weakref
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybridflow.agents.tools import check_arguments

NOBODY = 65534
"""uid and gid the sandbox drops to when it runs as root."""

STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed")

_HEADER = b"\x1ehybridflow-sandbox "  # the bootstrap's report, first line of stderr
_SETUP_FAILED = "[sandbox] setting up the run failed: "
_SETUP_EXIT = 126
_HARD_CAP_FACTOR = 4
_DRAIN_S = 0.5  # after the program exits, how long a stray descendant may hold its pipes
_MEMORY_HINTS = re.compile(
    r"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory|Unable to allocate",
    re.IGNORECASE,
)
_T = TypeVar("_T")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): the message says what to fix."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one program run; the defaults suit tool calls and test-case runs."""

    timeout_s: float = 10.0
    """Wall-clock seconds, interpreter start included, before the process group is killed."""

    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU at this limit, SIGKILL a second later."""

    memory_bytes: int = 1 << 30
    """Address space per process (RLIMIT_AS): larger allocations fail with MemoryError."""

    file_bytes: int = 16 << 20
    """Largest file the program may write (RLIMIT_FSIZE); a larger write fails with EFBIG."""

    max_processes: int = 16
    """Processes and threads the program may have at once, itself included (RLIMIT_NPROC)."""

    max_output_bytes: int = 64 << 10
    """Bytes kept of stdout and of stderr each; past 4x this in all the program is stopped."""

    network: bool = False
    """Allow network access. False runs the program in an empty network namespace where the
    machine allows it (see `sandbox_capabilities()`)."""

    concurrency: int = 8
    """Programs one `Sandbox` runs at once (per event loop); further runs wait their turn."""

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s", "memory_bytes", "file_bytes", "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.max_processes < 1 or self.concurrency < 1:
            raise ValueError("SandboxLimits.max_processes and .concurrency must be >= 1")


@dataclass
class SandboxResult:
    """How one run ended. stdout and stderr are capped, with a marker line where cut."""

    status: str
    """One of STATUSES: "ok" (exit 0), "error" (nonzero exit), "timeout", "cpu_limit",
    "memory_limit", "output_limit", "killed" (another signal)."""
    returncode: int | None
    """The exit code, or minus the signal that ended the program."""
    stdout: str
    stderr: str
    wall_s: float
    reason: str = ""
    """Why the sandbox says the program stopped, when a limit stopped it."""
    isolation: dict[str, Any] = field(default_factory=dict)
    """What the run was isolated with: user (uid), network_isolated, network_namespace,
    process_limit, unenforced (limits that did not hold), notes (why a namespace failed)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def message(self) -> str:
        """One line for the model: the limit hit, or the error's last line."""
        if self.status == "ok":
            return "the program finished normally"
        if self.reason:
            return self.reason
        if self.status == "error":
            lines = [line for line in _program_stderr(self.stderr).splitlines() if line.strip()]
            return lines[-1].strip() if lines else f"the program exited with code {self.returncode}"
        return f"the program stopped ({self.status}, code {self.returncode})"


def _program_stderr(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("[sandbox] "))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} bytes"


def classify(
    returncode: int | None,
    stderr: str,
    wall_s: float,
    limits: SandboxLimits,
    *,
    timed_out: bool = False,
    output_stopped: bool = False,
) -> tuple[str, str]:
    """(status, reason) of an ended run.

    Certain: the sandbox's own kills (timeout, output) and SIGXCPU. Heuristics, since the
    kernel does not say which limit a failure came from: a failed run whose stderr shows an
    allocation failure (MemoryError, "Cannot allocate memory", bad_alloc) hit the memory
    limit; a SIGKILL the sandbox did not send, after at least `cpu_s` of wall time, is the
    CPU hard limit (SIGXCPU ignored); any other signal is "killed".
    """
    if timed_out:
        return "timeout", f"TimeoutError: the program ran longer than {limits.timeout_s:g} s"
    if output_stopped:
        cap = _size(_HARD_CAP_FACTOR * limits.max_output_bytes)
        return "output_limit", f"the program wrote more than {cap} of output and was stopped"
    cpu_reason = f"the program used more than {limits.cpu_s} s of CPU time and was stopped"
    if returncode == -signal.SIGXCPU:
        return "cpu_limit", cpu_reason
    if returncode not in (0, None) and _MEMORY_HINTS.search(_program_stderr(stderr)[-4000:]):
        return "memory_limit", (
            f"MemoryError: the program tried to use more than {_size(limits.memory_bytes)} "
            f"of memory"
        )
    if returncode == -signal.SIGKILL and wall_s >= limits.cpu_s:
        return "cpu_limit", cpu_reason
    if returncode == -signal.SIGXFSZ:
        return "error", f"the program wrote a file larger than {_size(limits.file_bytes)}"
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else ""
        return "killed", f"the program was killed by signal {name or -returncode}"
    return ("ok" if returncode == 0 else "error"), ""


# -- the bootstrap: runs in the child interpreter (python -I -S -c), stdlib only ----------


def _child_tasks_of(uid: int) -> int:
    """Threads whose real uid is `uid`, over /proc: what RLIMIT_NPROC counts for that user."""
    import os

    total = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                text = status.read()
        except OSError:
            continue  # the process ended meanwhile
        real_uid = threads = None
        for line in text.splitlines():
            if line.startswith("Uid:"):
                real_uid = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        if real_uid == uid and threads:
            total += threads
    return total


def _child_main(config: dict) -> None:
    """Set the limits and namespaces, drop root, report on stderr, exec the program."""
    import ctypes
    import json
    import os
    import resource

    clone_newns, clone_newuser, clone_newnet = 0x00020000, 0x10000000, 0x40000000
    ms_nosuid, ms_nodev, ms_bind, ms_rec, ms_private = 2, 4, 4096, 16384, 1 << 18
    unenforced: list[str] = []
    notes: list[str] = []
    libc = []

    def call_libc(name: str, *args) -> bool:
        try:
            if not libc:
                libc.append(ctypes.CDLL(None, use_errno=True))
            if getattr(libc[0], name)(*args) == 0:
                return True
            notes.append(f"{name}: {os.strerror(ctypes.get_errno())}")
        except (OSError, AttributeError) as error:
            notes.append(f"{name}: {error}")
        return False

    def set_limit(kind: str, soft: int, hard: int | None = None) -> None:
        try:
            resource.setrlimit(getattr(resource, kind), (soft, soft if hard is None else hard))
        except (ValueError, OSError, AttributeError) as error:
            unenforced.append(f"{kind} ({error})")

    def expose(hidden: list) -> bool:
        """Cover each directory nobody cannot enter with a tmpfs holding only what it needs."""
        if not (call_libc("unshare", clone_newns)
                and call_libc("mount", b"none", b"/", None, ms_rec | ms_private, None)):  # fmt: skip
            return False
        for directory, names in hidden:
            keep = {name: os.open(os.path.join(directory, name), os.O_PATH) for name in names}
            if not call_libc("mount", b"tmpfs", directory.encode(), b"tmpfs",
                             ms_nosuid | ms_nodev, b"mode=0755,size=64k"):  # fmt: skip
                return False
            for name, fd in keep.items():
                target, source = os.path.join(directory, name), f"/proc/self/fd/{fd}"
                if os.path.isdir(source):
                    os.mkdir(target)
                else:
                    open(target, "x").close()
                if not call_libc("mount", source.encode(), target.encode(), None,
                                 ms_bind | ms_rec, None):  # fmt: skip
                    return False
                os.close(fd)
        return True

    def cannot_run(uid: int, needed: list) -> str:
        """Why `uid` could not run the interpreter here ("" if it can), tried as that user."""
        try:
            os.setgroups([])
            os.setegid(uid)
            os.seteuid(uid)
        except OSError as error:
            return f"cannot switch to user {uid}: {error}"
        try:
            for path in [config["python"], *needed]:
                if not os.access(path, os.R_OK | os.X_OK, effective_ids=True):
                    return f"user {uid} cannot reach {path}"
            return ""
        finally:
            os.seteuid(0)
            os.setegid(0)

    set_limit("RLIMIT_CORE", 0)
    set_limit("RLIMIT_FSIZE", config["file_bytes"])
    set_limit("RLIMIT_CPU", config["cpu_s"], config["cpu_s"] + 1)
    network_isolated = not config["network"] and call_libc("unshare", clone_newnet)
    user_namespace = False
    uid = os.getuid()
    if uid == 0:
        target = config["drop_to"]
        try:
            if config["hidden"] and not expose(config["hidden"]):
                notes.append("could not make the interpreter reachable for nobody")
        except OSError as error:
            notes.append(f"could not make the interpreter reachable for nobody: {error}")
        why = cannot_run(target, config["needed"])
        if not why:
            base = config["count_tasks"](target)
            os.setgroups([])
            os.setresgid(target, target, target)
            os.setresuid(target, target, target)
            uid = target
        else:
            base = 0
            unenforced.append(f"max_processes, since the program runs as root ({why})")
    else:
        base = max(0, config["count_tasks"](uid) - 1)  # less this process
    if not config["network"] and not network_isolated and uid != 0:
        # Without root, a network namespace needs a user namespace of its own. Its process
        # count starts at zero, so the process limit is then max_processes itself.
        network_isolated = call_libc("unshare", clone_newuser | clone_newnet)
        user_namespace = network_isolated
    process_limit = config["max_processes"] + (0 if user_namespace else base)
    set_limit("RLIMIT_NPROC", process_limit)
    set_limit("RLIMIT_AS", config["memory_bytes"])
    report = {
        "user": uid,
        "network_isolated": network_isolated,
        "network_namespace": os.readlink("/proc/self/ns/net") if network_isolated else None,
        "process_limit": process_limit,
        "unenforced": unenforced,
        "notes": notes,
    }
    os.write(2, config["header"].encode() + json.dumps(report).encode() + b"\n")
    os.execv(config["python"], [config["python"], "-I", config["program"]])


@functools.cache
def _bootstrap_source() -> str:
    functions = "\n\n".join(inspect.getsource(f) for f in (_child_tasks_of, _child_main))
    return (
        "from __future__ import annotations\nimport json, sys\n\n"
        f"{functions}\n\n"
        "config = json.loads(sys.argv[1])\n"
        "config['count_tasks'] = _child_tasks_of\n"
        "try:\n"
        "    _child_main(config)\n"
        "except BaseException as error:  # fail closed: the program does not run\n"
        f"    sys.stderr.write(f'{_SETUP_FAILED}{{type(error).__name__}}: {{error}}\\n')\n"
        f"    sys.exit({_SETUP_EXIT})\n"
    )


def _reachable_by(path: str, uid: int) -> bool:
    """Whether `uid` (in no group but its own) may enter directory `path`, by mode bits."""
    info = os.stat(path)
    if info.st_uid == uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid == uid:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


@functools.cache
def _interpreter_paths() -> tuple[str, ...]:
    """Paths the program's interpreter must reach: the executable and its libraries."""
    paths = {sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix}
    paths.update(sysconfig.get_paths().get(key, "") for key in ("stdlib", "purelib", "platlib"))
    paths.update(os.path.realpath(path) for path in list(paths))
    return tuple(sorted(path for path in paths if path and os.path.exists(path)))


@functools.cache
def _hidden_directories(uid: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(directory, entries) for each directory `uid` cannot enter on the way to the
    interpreter or the temporary directory: what the bootstrap covers with a tmpfs."""
    hidden: dict[str, set[str]] = {}
    for path in (*_interpreter_paths(), os.path.realpath(tempfile.gettempdir())):
        current = "/"
        for name in path.strip("/").split("/"):
            if not _reachable_by(current, uid):
                if current != "/":
                    hidden.setdefault(current, set()).add(name)
                break
            current = os.path.join(current, name)
    return tuple((directory, tuple(sorted(names))) for directory, names in sorted(hidden.items()))


def _environment(workdir: str) -> dict[str, str]:
    """Only what a program needs; one thread per math library, to fit the process limit."""
    bin_dir = os.path.dirname(sys.executable)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _remove_tree(path: str) -> None:
    """rmtree that also removes what the program made unreadable (chmod 000)."""

    def retry(function, failed_path, _):
        try:
            os.chmod(os.path.dirname(failed_path), 0o700)
            if os.path.isdir(failed_path) and not os.path.islink(failed_path):
                os.chmod(failed_path, 0o700)
            function(failed_path)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


def _kill_namespace(namespace: str | None) -> None:
    """SIGKILL every process in the run's own network namespace: those that left the
    process group (setsid, start_new_session) and so escaped the group kill."""
    if not namespace:
        return
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == namespace:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue  # gone, or not ours to inspect


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Program(asyncio.SubprocessProtocol):
    """The running program as asyncio sees it: output kept as it arrives (the first `keep`
    bytes of each stream), its exit, and its pipes closing.

    Exit is watched apart from the pipes: a child the program leaves behind may hold them
    open, and `asyncio.subprocess.Process.wait()` would wait for those too.
    """

    def __init__(self, keep: int, hard_cap: int):
        loop = asyncio.get_running_loop()
        self.keep, self.hard_cap = keep, hard_cap
        self.data = {1: bytearray(), 2: bytearray()}
        self.seen = {1: 0, 2: 0}
        self.overflowed = False
        self.exited = loop.create_future()
        self.closed = {1: loop.create_future(), 2: loop.create_future()}
        self.pid: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.pid = transport.get_pid()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buffer = self.data[fd]
        keep = self.keep + (4096 if fd == 2 else 0)  # room for the bootstrap's line
        self.seen[fd] += len(data)
        if len(buffer) < keep:
            buffer += data[: keep - len(buffer)]
        if not self.overflowed and sum(self.seen.values()) > self.hard_cap:
            self.overflowed = True
            _kill_group(self.pid)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd in self.closed and not self.closed[fd].done():
            self.closed[fd].set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def stop(self) -> None:
        """Kill the program's process group and whatever else runs in its namespace."""
        if self.pid is not None:
            _kill_group(self.pid)
        _kill_namespace(_split_header(bytes(self.data[2]))[0].get("network_namespace"))

    def text(self, fd: int, skip: int = 0) -> str:
        total = self.seen[fd] - skip
        text = bytes(self.data[fd][skip : skip + self.keep]).decode("utf-8", errors="replace")
        if total > self.keep:
            at_least = "at least " if self.overflowed else ""
            text += f"\n[output truncated: {self.keep} of {at_least}{total} bytes shown]"
        return text


def _split_header(stderr: bytes) -> tuple[dict, int]:
    """The bootstrap's report and its length, from the start of stderr."""
    if not stderr.startswith(_HEADER):
        return {}, 0
    end = stderr.find(b"\n")
    if end < 0:
        return {}, 0
    try:
        return json.loads(stderr[len(_HEADER) : end]), end + 1
    except json.JSONDecodeError:
        return {}, 0


async def _execute(code: str, limits: SandboxLimits, stdin_text: str | None) -> SandboxResult:
    root = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
    try:
        os.chmod(root, 0o711)  # nobody may reach the program and its directory, not list them
        program, workdir = os.path.join(root, "main.py"), os.path.join(root, "work")
        with open(program, "w", encoding="utf-8") as file:
            file.write(code)
        os.chmod(program, 0o644)
        os.mkdir(workdir, 0o700)
        as_root = os.geteuid() == 0
        if as_root:
            os.chown(workdir, NOBODY, NOBODY)
        config = {
            "python": sys.executable,
            "program": program,
            "cpu_s": int(limits.cpu_s),
            "memory_bytes": int(limits.memory_bytes),
            "file_bytes": int(limits.file_bytes),
            "max_processes": int(limits.max_processes),
            "network": limits.network,
            "drop_to": NOBODY,
            "hidden": _hidden_directories(NOBODY) if as_root else (),
            "needed": [*_interpreter_paths(), workdir] if as_root else [],
            "header": _HEADER.decode(),
        }
        return await _supervise(config, workdir, limits, stdin_text)
    finally:
        _remove_tree(root)


async def _supervise(
    config: dict, workdir: str, limits: SandboxLimits, stdin_text: str | None
) -> SandboxResult:
    loop = asyncio.get_running_loop()
    keep = limits.max_output_bytes
    started = time.monotonic()
    transport, program = await loop.subprocess_exec(
        lambda: _Program(keep, _HARD_CAP_FACTOR * keep),
        sys.executable, "-I", "-S", "-c", _bootstrap_source(), json.dumps(config),
        stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,
        env=_environment(workdir),
        start_new_session=True,
    )  # fmt: skip
    timed_out = False
    try:
        if stdin_text is not None:
            stdin = transport.get_pipe_transport(0)
            stdin.write(stdin_text.encode())
            stdin.close()  # after the buffer is written; a program that exits first is fine
        await asyncio.wait([program.exited], timeout=limits.timeout_s)
        if not program.exited.done():
            timed_out = True
            _kill_group(program.pid)
            await program.exited
        wall_s = time.monotonic() - started
        program.stop()  # what the program left running
        await asyncio.wait(list(program.closed.values()), timeout=_DRAIN_S)
    finally:  # also on cancellation: nothing of the program may outlive the call
        program.stop()
        if not program.exited.done():  # cancelled: see the kill land, so asyncio reaps it
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([program.exited], timeout=1.0)
        transport.close()
    isolation, header_len = _split_header(bytes(program.data[2]))
    returncode = transport.get_returncode()
    stderr = program.text(2, header_len)
    if returncode == _SETUP_EXIT and _SETUP_FAILED in stderr:
        raise SandboxError(stderr.strip())
    status, reason = classify(
        returncode,
        stderr,
        wall_s,
        limits,
        timed_out=timed_out,
        output_stopped=program.overflowed,
    )
    if isolation.get("unenforced"):
        marker = "[sandbox] not enforced here: " + "; ".join(isolation["unenforced"])
        stderr = f"{marker}\n{stderr}"
    return SandboxResult(
        status=status,
        returncode=returncode,
        stdout=program.text(1),
        stderr=stderr,
        wall_s=round(wall_s, 4),
        reason=reason,
        isolation=isolation,
    )


class Sandbox:
    """Runs programs under `limits`, at most `limits.concurrency` at once.

    The semaphore belongs to an event loop, so one is made per running loop on first use
    (a Sandbox built outside any loop, or used from several, works in each).
    """

    def __init__(self, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def _gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(self.limits.concurrency)
        return gate

    async def run(self, code: str, stdin_text: str | None = None) -> SandboxResult:
        """Run `code` as a program (stdin: `stdin_text`, else EOF); never raises for what
        the program does."""
        async with self._gate():
            return await _execute(code, self.limits, stdin_text)

    def run_sync(self, code: str, stdin_text: str | None = None) -> SandboxResult:
        return run_blocking(self.run(code, stdin_text))

    def __repr__(self) -> str:
        return f"Sandbox({self.limits})"


async def run_code(
    code: str, limits: SandboxLimits | None = None, stdin_text: str | None = None
) -> SandboxResult:
    """Run one program under `limits` (no concurrency limit across calls)."""
    return await Sandbox(limits).run(code, stdin_text)


def run_code_sync(
    code: str, limits: SandboxLimits | None = None, stdin_text: str | None = None
) -> SandboxResult:
    """`run_code` for synchronous callers, such as reward functions."""
    return run_blocking(run_code(code, limits, stdin_text))


def run_blocking(awaitable: Awaitable[_T]) -> _T:
    """Run a coroutine to completion from synchronous code, in a new event loop; from a
    thread that already runs a loop, in a helper thread (a loop cannot be re-entered)."""

    async def main() -> _T:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result()


@functools.cache
def sandbox_capabilities() -> dict[str, Any]:
    """What the sandbox enforces on this machine, found by running an empty program once:
    user (the uid programs run as), network_isolated, process_limit, unenforced, notes
    (why a namespace could not be made)."""
    result = run_code_sync("", SandboxLimits(timeout_s=60))
    if result.status != "ok":
        raise RuntimeError(f"the sandbox cannot run an empty program: {result.stderr[-2000:]}")
    return dict(result.isolation)


def network_isolation_available() -> bool:
    """Whether programs run without network when `SandboxLimits.network` is False."""
    return bool(sandbox_capabilities().get("network_isolated"))


def format_for_model(result: SandboxResult) -> str:
    """What the python tool answers: stdout, stderr (a traceback) and the limit hit."""
    parts = [text.rstrip("\n") for text in (result.stdout, result.stderr) if text.strip()]
    quiet = not _program_stderr(result.stderr).strip()
    if result.status not in ("ok", "error") or (result.status == "error" and quiet):
        parts.append(result.message())
    return "\n".join(parts) if parts else "(no output)"


class PythonTool:
    """The "python" tool: each call runs its code as a new program in the sandbox and
    answers with the output. Program errors are answers too (the model should read the
    traceback); only bad arguments raise ToolError."""

    name = "python"
    parameters = {
        "type": "object",
        "properties": {
            "code": {
                "type": "string",
                "description": "A complete Python 3 program; print() what you want to see.",
            }
        },
        "required": ["code"],
    }

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        limits = sandbox.limits
        network = "" if limits.network else " No network access."
        self.description = (
            "Run Python 3 code in a fresh process and return its stdout (and stderr if "
            "any). Nothing persists between calls: each call is a new program, so print() "
            f"the values you need.{network} Limits: {limits.timeout_s:g} s, "
            f"{_size(limits.memory_bytes)} of memory."
        )

    async def __call__(self, arguments: dict) -> str:
        check_arguments(self.name, self.parameters, arguments)
        return format_for_model(await self.sandbox.run(arguments["code"]))

    def __repr__(self) -> str:
        return f"PythonTool({self.sandbox!r})"
