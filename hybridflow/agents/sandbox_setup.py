"""The sandbox's setup: what runs in the child interpreter before the program (namespaces,
the jail, rlimits, the drop to nobody; see sandbox.py for why a bootstrap and not a
preexec_fn), and what the parent works out for it (the directories nobody cannot reach,
the environment).

The `_child_*` functions here and the `_jail_*` ones of sandbox_jail.py are sent to the
child as source (`bootstrap_source`), so they use nothing but their arguments, the standard
library they import and each other.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import stat
import sys
import sysconfig
import tempfile

from hybridflow.agents.sandbox_jail import (
    _jail_build,
    _jail_enter,
    _jail_init,
    _jail_mount,
    _jail_pivot,
    _jail_wait,
)
from hybridflow.agents.sandbox_seccomp import _seccomp_install

NOBODY = 65534
_HEADER = b"\x1ehybridflow-sandbox "  # the bootstrap's report, first line of stderr
_SETUP_FAILED = "[sandbox] setting up the run failed: "
_SETUP_EXIT = 126


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


def _child_cannot_run(uid: int, paths: list) -> str:
    """Why `uid` could not run the interpreter ("" if it can), tried as that user (as root)."""
    import os

    try:
        os.setgroups([])
        os.setegid(uid)
        os.seteuid(uid)
    except OSError as error:
        return f"cannot switch to user {uid}: {error}"
    try:
        for path in paths:
            if not os.access(path, os.R_OK | os.X_OK, effective_ids=True):
                return f"user {uid} cannot reach {path}"
        return ""
    finally:
        os.seteuid(0)
        os.setegid(0)


def _child_expose(hidden: list, libc_call) -> str:
    """Basic isolation as root: in a private mount namespace, cover each directory nobody
    cannot enter with a tmpfs holding only what the interpreter needs ("" or what failed)."""
    import os

    ms_nosuid, ms_nodev, ms_bind, ms_rec, ms_private = 2, 4, 4096, 16384, 1 << 18
    error = libc_call("unshare", 0x20000) or libc_call(
        "mount", b"none", b"/", None, ms_rec | ms_private, None)  # fmt: skip
    for directory, names in hidden if not error else ():
        keep = {name: os.open(os.path.join(directory, name), os.O_PATH) for name in names}
        error = libc_call("mount", b"tmpfs", directory.encode(), b"tmpfs",
                          ms_nosuid | ms_nodev, b"mode=0755,size=64k")  # fmt: skip
        for name, fd in keep.items() if not error else ():
            target, source = os.path.join(directory, name), f"/proc/self/fd/{fd}"
            if os.path.isdir(source):
                os.mkdir(target)
            else:
                open(target, "x").close()
            error = error or libc_call("mount", source.encode(), target.encode(), None,
                                       ms_bind | ms_rec, None)  # fmt: skip
            os.close(fd)
        if error:
            break
    return error


def _child_main(config: dict) -> None:
    """Set the limits, enter the jail (strict) or the namespaces the host allows (basic),
    drop root, report on stderr, exec the program. Never returns."""
    import ctypes
    import os
    import resource

    libc = ctypes.CDLL(None, use_errno=True)
    unenforced: list[str] = []

    def libc_call(name: str, *args) -> str:
        """An empty string if the call succeeded, else what failed."""
        if getattr(libc, name)(*args) == 0:
            return ""
        return f"{name}: {os.strerror(ctypes.get_errno())}"

    def set_limit(kind: str, soft: int, hard: int | None = None) -> None:
        try:
            resource.setrlimit(getattr(resource, kind), (soft, soft if hard is None else hard))
        except (ValueError, OSError, AttributeError) as error:
            unenforced.append(f"{kind} ({error})")

    def launch(process_limit: int, report: dict, program: str, drop_to) -> None:
        """The last limits, the drop to `drop_to`, the report, the exec."""
        set_limit("RLIMIT_NPROC", process_limit)
        set_limit("RLIMIT_AS", config["memory_bytes"])
        set_limit("RLIMIT_NOFILE", config["max_open_files"])
        if drop_to is not None:
            os.setgroups([])
            os.setresgid(drop_to, drop_to, drop_to)
            os.setresuid(drop_to, drop_to, drop_to)
        libc_call("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid files do nothing
        why = _seccomp_install(libc_call)  # no new namespaces (sandbox_seccomp.py)
        if why and config["isolation"] == "strict":
            raise OSError(f"cannot deny the program new namespaces ({why})")
        if why:
            unenforced.append(f"no new namespaces, memfd_create or shmget ({why})")
        report.update(user=os.getuid(), process_limit=process_limit, unenforced=unenforced)
        os.write(2, config["header"].encode() + json.dumps(report).encode() + b"\n")
        os.execv(config["python"], [config["python"], "-I", program])

    set_limit("RLIMIT_CORE", 0)
    set_limit("RLIMIT_FSIZE", config["file_bytes"])
    set_limit("RLIMIT_CPU", config["cpu_s"], config["cpu_s"] + 1)
    if config["isolation"] == "strict":
        _child_strict(config, libc_call, launch, unenforced)
    else:
        _child_basic(config, libc_call, launch, unenforced)


def _child_strict(config: dict, libc_call, launch, unenforced: list) -> None:
    """Strict isolation: the jail (sandbox_jail.py). Fails closed: the program does not run
    if any part of the jail cannot be made."""
    import os

    nobody, as_root = config["nobody"], os.geteuid() == 0
    base = config["count_tasks"](nobody if as_root else os.getuid())
    user_namespace, why = _jail_enter(config, libc_call)
    if why:
        raise OSError(f"cannot make the jail's namespaces ({why})")
    # In a fresh user namespace the process count starts at zero (see sandbox.py).
    process_limit = config["max_processes"] + (0 if user_namespace else base)
    drop_to = nobody if as_root and not user_namespace else None
    config["drop_to"] = drop_to
    read_end, write_end = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(read_end)

        def start(notes: list) -> None:
            try:
                os.close(write_end)
                why = _child_cannot_run(nobody, [config["python"], config["jail"]["workdir"]]) \
                    if drop_to is not None else ""  # fmt: skip
                if why:
                    raise OSError(f"{why}: make it readable by all (chmod o+rx) to run programs")
                os.chdir(config["jail"]["workdir"])
                report = {
                    "isolation": "strict",
                    "network_isolated": not config["network"],
                    "pid_namespace": os.readlink("/proc/self/ns/pid")
                    if os.path.exists("/proc/self") else None,
                    "notes": notes,
                }  # fmt: skip
                launch(process_limit, report, config["jail"]["program"], drop_to)
            except BaseException as error:
                os.write(2, f"{config['setup_failed']}{type(error).__name__}: {error}\n".encode())
                os._exit(config["setup_exit"])

        _jail_init(config, write_end, libc_call, start)
    os.close(write_end)
    _jail_wait(init, read_end)


def _child_basic(config: dict, libc_call, launch, unenforced: list) -> None:
    """Basic isolation: an empty network namespace where the host allows one, the drop to
    nobody as root; the program sees the host's files and processes."""
    import os

    clone_newuser, clone_newnet = 0x10000000, 0x40000000
    notes: list[str] = []
    error = "" if config["network"] else libc_call("unshare", clone_newnet)
    network_isolated = not config["network"] and not error
    notes += [error] if error else []
    user_namespace = False
    uid = os.getuid()
    if uid == 0:
        target = config["nobody"]
        try:
            error = _child_expose(config["hidden"], libc_call) if config["hidden"] else ""
        except OSError as failure:
            error = str(failure)
        if error:
            notes.append(f"could not make the interpreter reachable for nobody: {error}")
        why = _child_cannot_run(target, config["needed"])
        if not why:
            base, uid = config["count_tasks"](target), target
            os.setgroups([])
            os.setresgid(target, target, target)
            os.setresuid(target, target, target)
        else:
            base = 0
            unenforced.append(f"max_processes, since the program runs as root ({why})")
    else:
        base = max(0, config["count_tasks"](uid) - 1)  # less this process
    if not config["network"] and not network_isolated and uid != 0:
        # Without root, a network namespace needs a user namespace of its own. Its process
        # count starts at zero, so the process limit is then max_processes itself.
        error = libc_call("unshare", clone_newuser | clone_newnet)
        network_isolated = user_namespace = not error
        notes += [error] if error else []
    report = {
        "isolation": "basic",
        "network_isolated": network_isolated,
        "network_namespace": os.readlink("/proc/self/ns/net") if network_isolated else None,
        "notes": notes,
    }
    process_limit = config["max_processes"] + (0 if user_namespace else base)
    launch(process_limit, report, config["program"], None)


_CHILD_FUNCTIONS = (
    _child_tasks_of, _child_cannot_run, _child_expose, _child_main, _child_strict, _child_basic,
    _jail_mount, _jail_build, _jail_pivot, _jail_enter, _jail_init, _jail_wait, _seccomp_install,
)  # fmt: skip


@functools.cache
def bootstrap_source() -> str:
    functions = "\n\n".join(inspect.getsource(f) for f in _CHILD_FUNCTIONS)
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


def _environment(workdir: str, tmpdir: str) -> dict[str, str]:
    """Only what a program needs; one thread per math library, to fit the process limit."""
    bin_dir = os.path.dirname(sys.executable)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": tmpdir,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
