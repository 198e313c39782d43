"""Strict isolation: each test plants what a program should not reach and runs a program
that tries to reach it (host files, other processes, files of the previous program, more
/dev/shm than its share, a signal to every process). Where this machine cannot build the
jail the escape tests skip, saying why; the fallback's announcement and the refusal under
isolation=strict are tested on a simulated host without namespaces."""

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox's isolation is Linux-only", allow_module_level=True)

from hybridflow.agents.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    jail_unavailable,
    run_code_sync,
    sandbox_capabilities,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def strict_isolation():
    why = jail_unavailable()
    if why:
        pytest.skip(f"this machine cannot build the sandbox's jail: {why}")


def run(code: str, **limits) -> SandboxResult:
    result = run_code_sync(code, SandboxLimits(isolation="strict", **limits))
    assert result.isolation["isolation"] == "strict", result
    return result


TRY_READ = """
import sys
for path in sys.argv[1:] or {paths!r}:
    try:
        with open(path, "rb") as file:
            print(path, "READ", file.read(40))
    except OSError as error:
        print(path, type(error).__name__)
"""


@pytest.fixture()
def planted_file():
    """A file of "another run", readable by everyone (as checkpoints and logs usually are)."""
    directory = tempfile.mkdtemp(prefix="hybridflow-other-run-", dir="/tmp")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "checkpoint.txt")
    with open(path, "w") as file:
        file.write("secret weights")
    os.chmod(path, 0o644)
    yield path
    shutil.rmtree(directory)


def test_the_program_cannot_read_host_files(planted_file):
    paths = ["/etc/passwd", "/etc/shadow", str(REPO / "pyproject.toml"), __file__, planted_file,
             "/root/.bash_history", "/proc/1/environ", "/proc/1/cmdline"]  # fmt: skip
    lines = run(TRY_READ.format(paths=paths)).stdout.splitlines()
    assert len(lines) == len(paths)
    for line in lines:
        assert "READ" not in line, line
    # Of the repository's directory, the program sees at most the way to the interpreter.
    runtime = [Path(p) for p in (sys.prefix, sys.base_prefix, os.path.realpath(sys.executable))]
    on_the_way = {p.relative_to(REPO).parts[0] for p in runtime if REPO in p.parents}
    code = f"import os\nprint(os.listdir({str(REPO)!r}) if os.path.isdir({str(REPO)!r}) else [])"
    listing = run(code).stdout
    assert listing.startswith("[") and set(eval(listing)) <= on_the_way, listing


def test_control_under_basic_isolation_the_same_program_reads_them(planted_file):
    paths = ["/etc/passwd", planted_file]
    result = run_code_sync(TRY_READ.format(paths=paths), SandboxLimits(isolation="basic"))
    assert [line.split()[1] for line in result.stdout.splitlines()] == ["READ", "READ"]


def test_the_program_sees_only_its_own_processes():
    marker = "hybridflow-visible-to-no-program"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        code = textwrap.dedent(f"""
            import os
            pids = [p for p in os.listdir('/proc') if p.isdigit()]
            seen = []
            for pid in pids:
                try:
                    seen.append(open(f'/proc/{{pid}}/cmdline', 'rb').read())
                except OSError:
                    pass
            print(len(pids), any(b{marker!r} in cmdline for cmdline in seen))
        """)
        count, found = run(code).stdout.split()
    finally:
        host.kill()
        host.wait()
    assert found == "False"
    assert int(count) <= 2  # the jail's pid 1 and the program itself


WRITE_EVERYWHERE = """
import sys
for path in sys.argv[1:] or {paths!r}:
    try:
        with open(path, "w") as file:
            file.write("x")
        print(path, "written")
    except OSError as error:
        print(path, type(error).__name__)
"""


def test_files_a_program_writes_are_gone_for_the_next_one():
    name = f"left-{uuid.uuid4().hex}.txt"
    private = [name, f"/tmp/{name}", f"/dev/shm/{name}"]
    shared = [f"/usr/{name}", f"{os.path.dirname(os.__file__)}/{name}"]  # system, stdlib
    lines = run(WRITE_EVERYWHERE.format(paths=private + shared)).stdout.splitlines()
    written = dict(line.rsplit(" ", 1) for line in lines)
    assert [written[path] for path in private] == ["written"] * 3
    assert "written" not in [written[path] for path in shared]
    look = f"import os\nprint([path for path in {private!r} if os.path.exists(path)])"
    assert run(look).stdout == "[]\n"
    assert not [path for path in private[1:] + shared if os.path.exists(path)]


FILL_SHM = """
import os
written = 0
try:
    with open("/dev/shm/fill", "wb") as file:
        for _ in range(64):
            file.write(b"x" * (1 << 20))
            file.flush()
            written += 1 << 20
except OSError as error:
    print(written >> 20, error.strerror)
"""


def test_dev_shm_is_private_and_capped():
    before = shutil.disk_usage("/dev/shm").used
    result = run(FILL_SHM, scratch_bytes=8 << 20, file_bytes=128 << 20)
    mib, why = result.stdout.split(" ", 1)
    assert int(mib) <= 8 and why.strip() == "No space left on device", result
    assert abs(shutil.disk_usage("/dev/shm").used - before) < (4 << 20)  # the host's unused
    # The next program has its full share again: the last one's data went with it.
    assert run(FILL_SHM.replace("64", "4"), scratch_bytes=8 << 20).stdout == ""


MAKE_EMPTY_FILES = """
import os
made = 0
try:
    while made < 100_000:
        open(f"f{made}", "w").close()
        made += 1
except OSError as error:
    print(made, error.strerror)
"""


def test_the_scratch_holds_a_bounded_number_of_files():
    """Empty files take no space of the tmpfs, only kernel memory for their inodes: 180,000
    of them were made in 10 s past a 64 MiB cap. One per 4 KiB page of the scratch now."""
    result = run(MAKE_EMPTY_FILES, scratch_bytes=1 << 20)
    made, why = result.stdout.split(" ", 1)
    assert int(made) < (1 << 20) // 4096 and why.strip() == "No space left on device", result


def test_kill_of_every_process_does_not_reach_a_concurrent_program():
    sandbox = Sandbox(SandboxLimits(isolation="strict", concurrency=2, timeout_s=20))
    victim = "import time\ntime.sleep(3)\nprint('survived')"
    attacker = (
        "import os, signal, time\ntime.sleep(1)\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
        "except ProcessLookupError:\n    pass  # nothing else to signal\nprint('sent')"
    )

    async def both():
        return await asyncio.gather(sandbox.run(victim), sandbox.run(attacker))

    survivor, sender = asyncio.run(both())
    assert (survivor.status, survivor.stdout) == ("ok", "survived\n"), survivor
    assert sender.stdout == "sent\n"


def test_nothing_of_the_program_outlives_it():
    code = ("import subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
            "                 start_new_session=True)\nprint('started')")  # fmt: skip
    result = run(code)
    assert result.stdout == "started\n"
    namespace = result.isolation["pid_namespace"]
    assert namespace and not processes_in(namespace)


def processes_in(namespace: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_the_runtime_is_there_and_read_only():
    code = ("import json, os, sqlite3, ssl, sys\n"
            "print(sys.flags.isolated, os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'])\n"
            "import subprocess\n"
            "print(subprocess.run(['sh', '-c', 'echo shell'], capture_output=True).stdout)")  # fmt: skip
    assert run(code).stdout == "1 /sandbox/work /sandbox/work /tmp\nb'shell\\n'\n"


def test_capabilities_say_strict():
    assert sandbox_capabilities()["isolation"] == "strict"


# -- hosts without namespaces: simulated by a user namespace that allows no more of them and
#    a process without CAP_SYS_ADMIN ------------------------------------------------------

NO_NAMESPACES = textwrap.dedent("""
    import sys
    from hybridflow.agents.sandbox import SandboxError, SandboxLimits, run_code_sync
    result = run_code_sync("print('ran')", SandboxLimits(isolation=sys.argv[1]))
    print(result.stdout.strip(), result.isolation.get("isolation"))
    result = run_code_sync("print('again')", SandboxLimits(isolation=sys.argv[1]))
    print(result.stdout.strip(), result.isolation.get("isolation"))
""")


def run_without_namespaces(isolation: str) -> subprocess.CompletedProcess:
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("simulating a host without namespaces needs unshare and setpriv (util-linux)")
    shell = ("echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv "
             "--inh-caps=-sys_admin --bounding-set=-sys_admin \"$@\"")  # fmt: skip
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", shell, "sh",
         sys.executable, "-c", NO_NAMESPACES, isolation],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    if "unshare failed" in done.stderr or "setpriv:" in done.stderr:
        pytest.skip(f"cannot simulate a host without namespaces here: {done.stderr.strip()}")
    return done


def test_without_namespaces_programs_run_with_basic_isolation_said_once():
    done = run_without_namespaces("auto")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ran basic\nagain basic\n"
    assert done.stderr.count("code sandbox: basic isolation only") == 1, done.stderr
    assert "the jail is not possible here: cannot make the jail's namespaces" in done.stderr


def test_without_namespaces_strict_isolation_refuses_to_run():
    done = run_without_namespaces("strict")
    assert done.returncode != 0 and "ran" not in done.stdout
    assert "SandboxError: strict isolation was asked for (isolation=strict)" in done.stderr


def test_as_an_unprivileged_user_the_jail_uses_a_user_namespace():
    """The path of a developer's machine: not root, a user namespace of one id, in which the
    program may not make one of its own (where it would be root: -1, refused)."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or not python or not shutil.which("setpriv"):
        pytest.skip("runs as root, with a system /usr/bin/python3 and setpriv, to become nobody")
    code = (
        "import ctypes, os\nprint(os.getuid(), os.path.exists('/etc/passwd'), "
        "os.path.exists('/proc/1'), ctypes.CDLL(None).unshare(0x10000000))"
    )  # CLONE_NEWUSER
    script = ("from hybridflow.agents.sandbox import SandboxLimits, run_code_sync\n"
              f"result = run_code_sync({code!r}, SandboxLimits(isolation='strict'))\n"
              "print(result.stdout.strip(), result.isolation['isolation'])")  # fmt: skip
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script],
        capture_output=True, text=True, timeout=60, cwd="/",
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    if "Permission denied" in done.stderr or "No module named" in done.stderr:
        pytest.skip(f"user nobody cannot import hybridflow from {REPO}")
    if "cannot make the jail's namespaces" in done.stderr:
        pytest.skip(f"no unprivileged user namespaces here: {done.stderr.strip()[-300:]}")
    assert done.stdout == "65534 False False -1 strict\n", done.stderr
