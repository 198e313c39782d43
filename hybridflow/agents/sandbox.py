"""Running model-written Python in a separate process with limits, and the "python" tool.

Each program runs in a fresh interpreter (`sys.executable -I`, so the same packages are
importable and no PYTHON* variable applies) in its own session and process group, with a
minimal environment and stdin at EOF unless input is given. What stops a program:

  wall clock    the parent kills the whole process group (SIGKILL) -> "timeout"
  CPU time      RLIMIT_CPU, SIGXCPU at `cpu_s` and SIGKILL a second later -> "cpu_limit"
  memory        RLIMIT_AS; allocations fail, Python raises MemoryError -> "memory_limit"
  file size     RLIMIT_FSIZE; a larger write fails with EFBIG -> "error"
  processes     RLIMIT_NPROC; fork and thread creation fail with EAGAIN
  open files    RLIMIT_NOFILE; bounds what kernel buffers (sockets, pipes) can hold
  output        each stream keeps `max_output_bytes`; past 4x that in total the group is
                killed -> "output_limit"
  network       an empty network namespace (no interfaces, not even loopback up)
  namespaces    a seccomp filter refuses new ones (in its own user namespace a program is
                root and could mount a tmpfs past every limit), memfd_create and shmget
                (memory outside RLIMIT_AS and the scratch cap): sandbox_seccomp.py

Isolation (`SandboxLimits.isolation`):

  strict   a jail per program (sandbox_jail.py): its own mount, pid, ipc, uts and network
           namespaces; a root of its own where only an empty working directory, /tmp and
           /dev/shm (one tmpfs of `scratch_bytes`) are writable, the system and the
           interpreter are read-only, and /proc shows its own processes. It cannot read
           the machine's files, see or signal other programs, or leave files behind; when
           it ends, the kernel kills everything left in its pid namespace.
  basic    an empty temporary working directory, removed afterwards; the program sees the
           machine's files and processes with the rights of its user. Whatever it left
           running dies with its process group and its network namespace (which finds those
           that left the group with setsid); with `network=True`, or where no namespace
           could be made, a process that left the group outlives the run.
  auto     strict where the machine allows it (found once per process, `jail_unavailable`),
           else basic with a warning saying why.

The limits are set by a small bootstrap that runs in the child interpreter and then execs
the program, rather than by a `preexec_fn`: a preexec_fn runs Python between fork and
exec, which can deadlock in a parent that has threads (a trainer has many), and it stops
`subprocess` from using vfork, so every run would copy the page tables of a possibly huge
parent.

Root ignores RLIMIT_NPROC and should not run model code anyway, so as root the bootstrap
drops to `nobody` (uid/gid 65534) after creating the namespaces; without root (or without
CAP_SYS_ADMIN) the jail needs an unprivileged user namespace, where the program is nobody
too. Under basic isolation, where nobody cannot reach the interpreter (a Python under
/root, mode 0700), the bootstrap, in a private mount namespace, covers each such directory
with an empty tmpfs and binds back only the entries the interpreter needs. Where
privileges cannot be dropped, the program runs anyway and its stderr starts with a
"[sandbox] ..." line saying which limit is not enforced. `sandbox_capabilities()` reports
what this machine provides.

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
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Awaitable
from typing import Any, TypeVar

from hybridflow.agents.sandbox_jail import JAIL_WORKDIR, jail_config
from hybridflow.agents.sandbox_limits import (
    _HARD_CAP_FACTOR,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    _program_stderr,
    _size,
    classify,
)
from hybridflow.agents.sandbox_setup import (
    _HEADER,
    _SETUP_EXIT,
    _SETUP_FAILED,
    NOBODY,
    _environment,
    _hidden_directories,
    _interpreter_paths,
    bootstrap_source,
)
from hybridflow.agents.tool_protocol import check_arguments

log = logging.getLogger("hybridflow.sandbox")
_DRAIN_S = 0.5  # after the program exits, how long a stray descendant may hold its pipes
_T = TypeVar("_T")


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
    level = await _isolation_level(limits.isolation)
    return await _execute_at(level, code, limits, stdin_text)


async def _execute_at(
    level: str, code: str, limits: SandboxLimits, stdin_text: str | None
) -> SandboxResult:
    """Run `code` under isolation `level` ("strict" or "basic")."""
    root = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
    try:
        os.chmod(root, 0o711)  # nobody may reach the program and its directory, not list them
        program = os.path.join(root, "main.py")
        with open(program, "w", encoding="utf-8") as file:
            file.write(code)
        os.chmod(program, 0o644)
        config = {
            "isolation": level,
            "python": sys.executable,
            "program": program,
            "cpu_s": int(limits.cpu_s),
            "memory_bytes": int(limits.memory_bytes),
            "file_bytes": int(limits.file_bytes),
            "max_processes": int(limits.max_processes),
            "max_open_files": int(limits.max_open_files),
            "network": limits.network,
            "nobody": NOBODY,
            "header": _HEADER.decode(),
            "setup_failed": _SETUP_FAILED,
            "setup_exit": _SETUP_EXIT,
        }
        if level == "strict":
            config["jail"] = jail_config(root, program, limits.network, limits.scratch_bytes)
            return await _supervise(config, root, _environment(JAIL_WORKDIR, "/tmp"), limits,
                                    stdin_text)  # fmt: skip
        workdir = os.path.join(root, "work")
        os.mkdir(workdir, 0o700)
        as_root = os.geteuid() == 0
        if as_root:
            with contextlib.suppress(OSError):  # no nobody here: the program stays root
                os.chown(workdir, NOBODY, NOBODY)
        config["hidden"] = _hidden_directories(NOBODY) if as_root else ()
        config["needed"] = [sys.executable, *_interpreter_paths(), workdir] if as_root else []
        return await _supervise(config, workdir, _environment(workdir, workdir), limits,
                                stdin_text)  # fmt: skip
    finally:
        _remove_tree(root)


async def _isolation_level(requested: str) -> str:
    """What isolation `requested` ("auto", "strict", "basic") comes to here: strict or basic."""
    if requested == "basic":
        return "basic"
    if jail_unavailable.cache_info().currsize:
        why = jail_unavailable()
    else:  # the first run of this process: find out once, without blocking the loop
        why = await asyncio.to_thread(jail_unavailable)
    if not why:
        return "strict"
    if requested == "strict":
        raise SandboxError(
            f"strict isolation was asked for (isolation=strict), but this machine cannot "
            f"build the sandbox's jail: {why}. Run where namespaces are allowed (as root with "
            f"CAP_SYS_ADMIN, or with unprivileged user namespaces; a container needs "
            f"--cap-add SYS_ADMIN or --privileged), or accept isolation=basic "
            f"(docs/troubleshooting.md, section 'The code sandbox')"
        )
    return "basic"


@functools.cache
def jail_unavailable() -> str:
    """Why programs cannot run in the jail on this machine ("" when they can): found once per
    process by running an empty program in it, and said once (logged: info, or a warning
    when programs will run with basic isolation only)."""
    try:
        result = run_blocking(_execute_at("strict", "", SandboxLimits(timeout_s=60), None))
        why = "" if result.ok else f"an empty program ended with {result.status}: {result.stderr}"
    except SandboxError as error:
        why = str(error).removeprefix(_SETUP_FAILED).removeprefix("OSError: ").strip()
    if why:
        log.warning(
            "code sandbox: basic isolation only (programs can read what user nobody can and "
            "see other processes); the jail is not possible here: %s", why)  # fmt: skip
    else:
        log.info("code sandbox: strict isolation (each program in its own jail)")
    return why


async def _supervise(
    config: dict, cwd: str, env: dict, limits: SandboxLimits, stdin_text: str | None
) -> SandboxResult:
    loop = asyncio.get_running_loop()
    keep = limits.max_output_bytes
    started = time.monotonic()
    transport, program = await loop.subprocess_exec(
        lambda: _Program(keep, _HARD_CAP_FACTOR * keep),
        sys.executable, "-I", "-S", "-c", bootstrap_source(), json.dumps(config),
        stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
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
    isolation ("strict" or "basic"), user (the uid programs run as), network_isolated,
    process_limit, unenforced, notes (what the host did not allow), jail_unavailable (why
    there is no strict isolation here; "" where there is)."""
    result = run_code_sync("", SandboxLimits(timeout_s=60))
    if result.status != "ok":
        raise RuntimeError(f"the sandbox cannot run an empty program: {result.stderr[-2000:]}")
    return {**result.isolation, "jail_unavailable": jail_unavailable()}


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
