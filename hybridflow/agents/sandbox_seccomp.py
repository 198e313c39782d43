"""The seccomp filter a sandboxed program runs under: no new namespaces, no memory held outside
the limits.

Without it a program could `unshare -Urm`: in a user namespace of its own it is uid 0 with
every capability there, so it can mount a tmpfs and fill it with host memory that neither
RLIMIT_AS (file pages are no address space) nor the jail's scratch tmpfs counts; 1.5 GB
past a 64 MiB scratch was measured. The filter refuses, with EPERM:

  unshare, setns              any new or other namespace
  clone with a CLONE_NEW* flag
  memfd_create                an anonymous file: memory outside RLIMIT_AS and the scratch
                              cap (RLIMIT_FSIZE bounds one, not how many)
  shmget                      a SysV segment outlives its mapping (and, under basic
                              isolation, the program)
  msgget, semget              SysV message queues and semaphore sets outlive the program
                              under basic isolation too: 50 queues of up to 16 KiB each
                              were left behind by one (multiprocessing uses POSIX
                              semaphores, which stay allowed)

and clone3 with ENOSYS: its flags are in memory a filter cannot read, and ENOSYS makes
glibc (pthread_create, posix_spawn) fall back to clone, whose flags it can. A syscall of
another ABI (i386 through int 0x80, x32) kills the program: the numbers it checks are
those of the native ABI.

What a program can then fill: its address space (RLIMIT_AS, per process, times
max_processes), files (RLIMIT_FSIZE each; under strict isolation only the scratch tmpfs is
writable, `scratch_bytes` in all) and kernel buffers: socket buffers through its
descriptors (RLIMIT_NOFILE, `max_open_files`), pipes and message queues under per-user
limits of their own. Fork, threads and subprocess still work: their clone calls carry no
CLONE_NEW* flag.

`_seccomp_install` is sent to the child as source with the bootstrap (sandbox_setup.py),
so it uses only the standard library. The filter is classic BPF, built here rather than
with libseccomp because the bootstrap runs `python -I -S` (no site-packages) before
anything of the program's; it is installed by prctl(PR_SET_SECCOMP) after
PR_SET_NO_NEW_PRIVS, so it needs no privilege and holds across execve for the program and
everything it starts.
"""

from __future__ import annotations


def _seccomp_install(libc_call) -> str:
    """Install the filter (module docstring) on this thread and what it execs: "" or why it
    could not be (an unknown architecture, a kernel without seccomp)."""
    import ctypes
    import errno
    import os
    import struct

    # (audit arch, {syscall: number}) of the native ABIs; x86_64 also has x32's bit to refuse
    abis = {
        "x86_64": (0xC000003E, {"clone": 56, "unshare": 272, "setns": 308, "clone3": 435,
                                "memfd_create": 319, "shmget": 29, "msgget": 68,
                                "semget": 64}),
        "aarch64": (0xC00000B7, {"clone": 220, "unshare": 97, "setns": 268, "clone3": 435,
                                 "memfd_create": 279, "shmget": 194, "msgget": 186,
                                 "semget": 190}),
    }  # fmt: skip
    machine = os.uname().machine
    if machine not in abis:
        return f"no seccomp filter for {machine}"
    arch, number = abis[machine]
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|…|K, RET
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    eperm, enosys = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS  # SECCOMP_RET_ERRNO
    clone_new = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
    # seccomp_data: nr at 0, arch at 4, args[0] at 16 (its low 32 bits: little-endian)
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (load, 0, 0, 0)]
    if machine == "x86_64":
        program += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # __X32_SYSCALL_BIT
    for name, action in (("unshare", eperm), ("setns", eperm), ("memfd_create", eperm),
                         ("shmget", eperm), ("msgget", eperm), ("semget", eperm),
                         ("clone3", enosys)):  # fmt: skip
        program += [(jeq, 0, 1, number[name]), (ret, 0, 0, action)]
    program += [
        (jeq, 0, 3, number["clone"]),  # not clone: allow
        (load, 0, 0, 16),  # clone's flags
        (jset, 0, 1, clone_new),
        (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
    ]
    code = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
    filters = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program), ctypes.addressof(filters))
    # PR_SET_NO_NEW_PRIVS (38) first: without it an unprivileged process may not install one
    error = libc_call("prctl", 38, 1, 0, 0, 0)
    error = error or libc_call("prctl", 22, 2, ctypes.c_void_p(ctypes.addressof(fprog)), 0, 0)
    return f"seccomp filter: {error}" if error else ""
