"""The jail a program runs in under strict isolation: what it sees (`jail_plan`, worked out
in the parent) and how the bootstrap builds it (`_jail_*`, sent to the child as source with
the rest of the bootstrap, so they use only their arguments, the standard library and the
bootstrap's other functions).

The bootstrap unshares new user (unless it is root with CAP_SYS_ADMIN), mount, pid, ipc,
uts and (without `network`) network namespaces and forks. The child is pid 1 of the new
pid namespace: it mounts a size-capped tmpfs as the new root, binds into it read-only the
system directories (/usr and the /bin, /lib links), the interpreter's installation, the
virtual environment's bin and site-packages and a few device nodes, mounts a /proc of its
own pid namespace, copies the program in, pivots into the new root and detaches the old
one. It then forks the program, reaps whatever the program leaves behind, and exits when
the program does; the kernel then kills every process left in the namespace. The
bootstrap waits for it and exits as the program did, so the parent sees the program's
exit status or signal.

Inside, the program sees:

  /sandbox/main.py   the program
  /sandbox/work      its working directory and HOME, empty at start
  /tmp, /dev/shm     empty at start
  /proc              its own processes only
  /usr, /bin, ...    the system's programs and libraries, read-only, setuid ignored
  the interpreter    its installation, the venv's bin/ and site-packages, read-only

The working directory, /tmp and /dev/shm share one tmpfs of `scratch_bytes`: a write past
that fails with ENOSPC, and everything is gone when the program ends. Its files are capped
too, at one per page of it (SCRATCH_BYTES_PER_FILE): an empty file takes no page of the
tmpfs but about a kilobyte of kernel memory for its inode and name, and 10 s of creating
them made 180,000 (about 180 MB past the cap) before the cap.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig

from hybridflow.agents.sandbox_limits import SandboxError

SCRATCH_BYTES_PER_FILE = 4096
"""The scratch tmpfs holds at most scratch_bytes / this many files and directories."""

JAIL_DIR = "/sandbox"
JAIL_PROGRAM = f"{JAIL_DIR}/main.py"
JAIL_WORKDIR = f"{JAIL_DIR}/work"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl")


def _runtime_paths() -> list[str]:
    """The interpreter's installation (its prefix: binary, libpython, stdlib) and, in a
    virtual environment, the venv's bin/, pyvenv.cfg and library directory."""
    paths = [sys.base_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)]
    paths += [os.path.join(sys.prefix, "pyvenv.cfg")]
    names = ("stdlib", "platstdlib", "purelib", "platlib")
    paths += [sysconfig.get_paths().get(name, "") for name in names]
    return [os.path.realpath(path) for path in paths if path and os.path.exists(path)]


def _without_nested(paths: list[str]) -> list[str]:
    """Each path once, dropping those inside another (a bind of the outer one shows them)."""
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not any(path == outer or path.startswith(outer.rstrip("/") + "/") for outer in kept):
            kept.append(path)
    return sorted(kept)


@functools.cache
def jail_plan(network: bool) -> dict:
    """What the jail binds, links and creates, for the bootstrap's config.

    binds: (source on the host, path in the jail, "ro" or "dev"); links: (path, target)
    symlinks to create; refused: why no jail can be built from this layout ("" if it can).
    """
    binds, links = [], []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))  # merged /usr: /bin -> usr/bin
        elif os.path.isdir(path):
            binds.append((path, path, "ro"))
    system = [path for _, path, _ in binds]
    runtime = [path for path in _without_nested(_runtime_paths() + system) if path not in system]
    binds += [(path, path, "ro") for path in runtime]
    executable = os.path.abspath(sys.executable)
    if os.path.dirname(executable) != os.path.dirname(os.path.realpath(executable)) and not any(
        executable.startswith(path + "/") for path in runtime + system
    ):
        links.append((os.path.dirname(executable), os.path.dirname(os.path.realpath(executable))))
    binds += [(path, path, "dev") for path in _DEVICES if os.path.exists(path)]
    etc = ["/etc/ld.so.cache", *(_NETWORK_FILES if network else ())]
    for path in etc:
        if os.path.islink(path) and path != "/etc/ssl":
            links.append((path, os.readlink(path)))
        elif os.path.exists(path):
            binds.append((os.path.realpath(path), path, "ro"))
    if os.path.islink("/etc/localtime"):
        links.append(("/etc/localtime", os.readlink("/etc/localtime")))
    links += [("/dev/fd", "/proc/self/fd")]
    links += [(f"/dev/{name}", f"/proc/self/fd/{fd}") for fd, name in
              enumerate(("stdin", "stdout", "stderr"))]  # fmt: skip
    clash = [target for _, target, _ in binds if target == JAIL_DIR or
             target.startswith(JAIL_DIR + "/")]  # fmt: skip
    refused = f"the interpreter lives under {JAIL_DIR}, where the jail keeps programs" * bool(clash)
    return {"binds": binds, "links": links, "refused": refused}


def jail_config(root: str, program: str, network: bool, scratch_bytes: int) -> dict:
    """The jail's part of the bootstrap's config for a run whose temporary directory is
    `root` and whose program is the file `program`: the jail's mount point (an empty
    directory made in `root`) and what it shows (`jail_plan`)."""
    plan = jail_plan(network)
    if plan["refused"]:
        raise SandboxError(f"strict isolation is not possible here: {plan['refused']}")
    mount_point = os.path.join(root, "jail")
    os.mkdir(mount_point, 0o755)
    return {
        "root": mount_point,
        "scratch_bytes": int(scratch_bytes),
        "scratch_files": max(64, int(scratch_bytes) // SCRATCH_BYTES_PER_FILE),
        "binds": plan["binds"],
        "links": plan["links"],
        "dir": JAIL_DIR,
        "workdir": JAIL_WORKDIR,
        "program": JAIL_PROGRAM,
        "program_source": program,
    }


# -- the child side: sent as source, run by the bootstrap ---------------------------------


def _jail_mount(libc_call, source, target, fstype, flags, data) -> None:
    """mount(2), raising OSError with what failed."""
    encode = lambda value: None if value is None else str(value).encode()  # noqa: E731
    error = libc_call("mount", encode(source), encode(target), encode(fstype), flags, encode(data))
    if error:
        raise OSError(f"mount {source} on {target}: {error}")


def _jail_build(config: dict, libc_call) -> list[str]:
    """Build the new root at config["jail"]["root"] (pid 1, before pivoting); returns notes
    on what could not be provided (no /proc where the host forbids a new one)."""
    import os
    import stat

    ms_rdonly, ms_nosuid, ms_nodev, ms_noexec, ms_remount = 1, 2, 4, 8, 32
    ms_bind, ms_rec, ms_private = 4096, 16384, 1 << 18
    keep_flags = 1 | 2 | 4 | 8 | 1024 | 2048 | 4096  # statvfs bits a remount must repeat
    jail, notes = config["jail"], []
    root = jail["root"]
    inside = lambda path: root + path  # noqa: E731
    _jail_mount(libc_call, None, "/", None, ms_rec | ms_private, None)
    _jail_mount(libc_call, "tmpfs", root, "tmpfs", ms_nosuid | ms_nodev,
                f"size={jail['scratch_bytes']},nr_inodes={jail['scratch_files']},mode=0755")  # fmt: skip
    for path, mode in (("/tmp", 0o1777), ("/dev", 0o755), ("/dev/shm", 0o1777),
                       ("/proc", 0o555), (jail["dir"], 0o755), (jail["workdir"], 0o700)):  # fmt: skip
        os.makedirs(inside(path), exist_ok=True)
        os.chmod(inside(path), mode)
    if config["drop_to"] is not None:
        os.chown(inside(jail["workdir"]), config["drop_to"], config["drop_to"])
    for source, target, kind in jail["binds"]:
        if stat.S_ISDIR(os.stat(source).st_mode):
            os.makedirs(inside(target), exist_ok=True)
        else:
            os.makedirs(os.path.dirname(inside(target)), exist_ok=True)
            open(inside(target), "a").close()
        _jail_mount(libc_call, source, inside(target), None, ms_bind | ms_rec, None)
        extra = ms_nosuid | (ms_noexec if kind == "dev" else ms_rdonly | ms_nodev)
        flags = (os.statvfs(inside(target)).f_flag & keep_flags) | extra
        _jail_mount(libc_call, None, inside(target), None, ms_bind | ms_remount | flags, None)
    for path, target in jail["links"]:
        if not os.path.lexists(inside(path)):
            os.makedirs(os.path.dirname(inside(path)), exist_ok=True)
            os.symlink(target, inside(path))
    with open(jail["program_source"], "rb") as source, open(inside(jail["program"]), "wb") as out:
        out.write(source.read())
    os.chmod(inside(jail["program"]), 0o644)
    try:  # hidepid=2: as root, pid 1 (this process, its command line the config) is hidden
        _jail_mount(libc_call, "proc", inside("/proc"), "proc", ms_nosuid | ms_nodev | ms_noexec,
                    "hidepid=2")  # fmt: skip
    except OSError as error:  # e.g. a container hides parts of its /proc: none is better
        notes.append(f"no /proc in the jail ({error})")
    return notes


def _jail_pivot(root: str, libc_call) -> None:
    """Make `root` the root directory and detach the old one, so no path leads out."""
    import os

    numbers = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
    number = numbers.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: unknown system call number on {os.uname().machine}")
    os.chdir(root)
    error = libc_call("syscall", number, b".", b".")
    if error:
        raise OSError(f"pivot_root: {error}")
    error = libc_call("umount2", b".", 2)  # MNT_DETACH: the old root, stacked on the new
    if error:
        raise OSError(f"umount of the old root: {error}")
    os.chdir("/")


def _jail_enter(config: dict, libc_call) -> tuple[bool, str]:
    """unshare(2) the jail's namespaces: (whether a user namespace was needed, "" or why
    none could be made). Root with CAP_SYS_ADMIN needs none; anyone else maps one id, its
    own, to `nobody` inside, so the program looks unprivileged there too."""
    import os

    new_ns, new_uts, new_ipc, new_user, new_pid, new_net = (
        0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)  # fmt: skip
    flags = new_ns | new_uts | new_ipc | new_pid | (0 if config["network"] else new_net)
    if os.geteuid() == 0:
        error = libc_call("unshare", flags)
        if not error:
            return False, ""
        try:  # root without CAP_SYS_ADMIN: become nobody, then try a user namespace
            os.setgroups([])
            os.setresgid(config["nobody"], config["nobody"], config["nobody"])
            os.setresuid(config["nobody"], config["nobody"], config["nobody"])
        except OSError as drop:
            return False, f"{error}; and cannot become nobody to try a user namespace: {drop}"
    uid, gid = os.getuid(), os.getgid()
    error = libc_call("unshare", flags | new_user)
    if error:
        return True, f"unshare of a user namespace: {error}"
    nobody = config["nobody"]
    for name, text in (("setgroups", "deny"), ("uid_map", f"{nobody} {uid} 1"),
                       ("gid_map", f"{nobody} {gid} 1")):  # fmt: skip
        with open(f"/proc/self/{name}", "w") as file:
            file.write(text)
    return True, ""


def _jail_init(config: dict, report_fd: int, libc_call, launch) -> None:
    """pid 1 of the jail: build it, start the program (`launch(notes)` in a child, which
    never returns), reap everything until the program ends, write its wait status to
    `report_fd`, exit (the kernel then kills what is left). Never returns."""
    import os
    import signal
    import sys

    try:
        libc_call("prctl", 1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: die with the bootstrap
        # PR_SET_DUMPABLE 0: with /proc's hidepid=2 the program cannot see this process even
        # where it runs as the same user (a user namespace); execve makes it dumpable again
        libc_call("prctl", 4, 0)
        notes = _jail_build(config, libc_call)
        _jail_pivot(config["jail"]["root"], libc_call)
        program = os.fork()
    except BaseException as error:
        sys.stderr.write(f"{config['setup_failed']}{type(error).__name__}: {error}\n")
        sys.stderr.flush()
        os._exit(config["setup_exit"])
    if program == 0:
        launch(notes)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(config["setup_exit"])
        if pid == program:
            os.write(report_fd, str(status).encode())
            os._exit(0)


def _jail_wait(init: int, report_fd: int) -> None:
    """The bootstrap, outside the jail's pid namespace: wait for pid 1, then end as the
    program did (its exit code, or killed by its signal). Never returns."""
    import os
    import signal

    _, init_status = os.waitpid(init, 0)
    report = os.read(report_fd, 64)
    status = int(report) if report else init_status
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
