"""What a sandboxed run may use (SandboxLimits), what comes back (SandboxResult), and how the
way a program ended is read from its exit status and stderr (classify)."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any

# past this many times max_output_bytes in all, the program's group is killed
_HARD_CAP_FACTOR = 4

ISOLATION_LEVELS = ("auto", "strict", "basic")

STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed")

_MEMORY_HINTS = re.compile(
    r"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory|Unable to allocate",
    re.IGNORECASE,
)


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

    max_open_files: int = 256
    """File descriptors per process (RLIMIT_NOFILE). It bounds the memory a program can hold
    in kernel buffers, which no other limit counts: a socket pair filled to its send buffer
    (~200 KiB) per two descriptors, about 25 MiB a process at 256."""

    max_output_bytes: int = 64 << 10
    """Bytes kept of stdout and of stderr each; past 4x this in all the program is stopped."""

    network: bool = False
    """Allow network access. False runs the program in an empty network namespace where the
    machine allows it (see `sandbox_capabilities()`)."""

    concurrency: int = 8
    """Programs one `Sandbox` runs at once (per event loop); further runs wait their turn."""

    isolation: str = "auto"
    """"strict": each program in a jail of its own (sandbox_jail.py): it sees only its own
    empty directory, /tmp and /dev/shm, a read-only system and interpreter, and its own
    processes; a machine that cannot build the jail refuses to run programs (SandboxError).
    "basic": no jail; the program sees the machine's files (as nobody, when run as root)
    and processes. "auto": strict where this machine allows it, else basic, said once in a
    warning (`sandbox_capabilities()`)."""

    scratch_bytes: int = 64 << 20
    """Under strict isolation, bytes the program may keep in files at once: its directory,
    /tmp and /dev/shm together (memory-backed); a write past it fails with ENOSPC."""

    def __post_init__(self):
        if self.isolation not in ISOLATION_LEVELS:
            raise ValueError(
                f"SandboxLimits.isolation must be one of {ISOLATION_LEVELS}, got {self.isolation!r}"
            )
        for name in ("timeout_s", "cpu_s", "memory_bytes", "file_bytes", "max_output_bytes",
                     "scratch_bytes", "max_open_files"):  # fmt: skip
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
    """What the run was isolated with: isolation ("strict" or "basic"), user (uid),
    network_isolated, network_namespace (basic), process_limit, unenforced (limits that did
    not hold), notes (what the host did not allow)."""

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
