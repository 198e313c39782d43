"""The sandbox's setup: what runs in the child interpreter before the program (namespaces,
rlimits, the drop to nobody; see sandbox.py for why a bootstrap and not a preexec_fn), and
what the parent works out for it (the directories nobody cannot reach, the environment).

`_child_main` and `_child_tasks_of` are sent to the child as source (`bootstrap_source`), so
they use nothing from this module but their arguments and the standard library they import.
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


def _child_main(config: dict) -> None:
    """Set the limits and namespaces, drop root, report on stderr, exec the program."""
    import ctypes
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
def bootstrap_source() -> str:
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
