"""The code sandbox: each limit hit by a program and reported with its status, with the
host unharmed afterwards; isolation (cwd, stdin, network, user); concurrency; the tool."""

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox's isolation is Linux-only", allow_module_level=True)

from hybridflow.agents.sandbox import (
    PythonTool,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    classify,
    network_isolation_available,
    run_code,
    run_code_sync,
    sandbox_capabilities,
)
from hybridflow.agents.tools import ToolError, openai_schema


def run(code: str, stdin_text: str | None = None, **limits) -> SandboxResult:
    return run_code_sync(code, SandboxLimits(**limits), stdin_text)


def assert_ended(pid: int) -> None:
    """The process is gone or a zombie (killed, waiting for init to reap it)."""
    deadline = time.monotonic() + 2
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(") ", 1)[1][0]
        except FileNotFoundError:
            return
        if state in "ZX":
            return
        assert time.monotonic() < deadline, f"process {pid} still running (state {state})"
        time.sleep(0.02)


def assert_host_can_spawn():
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout == b"1\n"


def test_a_program_runs_and_its_output_comes_back():
    result = run("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (result.status, result.returncode) == ("ok", 0)
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.message() == "the program finished normally"


def test_an_exception_is_an_error_with_the_traceback():
    result = run("x = 1\nraise ValueError('bad value')")
    assert (result.status, result.returncode) == ("error", 1)
    assert "Traceback" in result.stderr and "main.py" in result.stderr
    assert result.message() == "ValueError: bad value"


def test_wall_clock_timeout_kills_the_program():
    started = time.monotonic()
    result = run("import time\ntime.sleep(60)", timeout_s=0.5)
    assert result.status == "timeout"
    assert result.message() == "TimeoutError: the program ran longer than 0.5 s"
    assert time.monotonic() - started < 3
    assert_host_can_spawn()


def test_busy_loop_hits_the_cpu_limit():
    result = run("while True:\n    pass", cpu_s=1, timeout_s=8)
    assert result.status == "cpu_limit", result
    assert 0.9 < result.wall_s < 5
    assert "CPU" in result.message()


def test_allocating_past_the_memory_limit():
    result = run("data = bytearray(2 * 1024**3)\nprint('allocated')", memory_bytes=256 << 20)
    assert result.status == "memory_limit", result
    assert "allocated" not in result.stdout
    assert "MemoryError" in result.message() and "256 MiB" in result.message()
    assert bytearray(64 << 20)  # the limit was the program's, not ours


def test_writing_past_the_file_size_limit_fails_the_write():
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * 100_000_000)"
    result = run(code, file_bytes=1 << 20)
    assert result.status == "error", result
    assert "File too large" in result.stderr


FILL_SOCKET_BUFFERS = """
import socket
pairs = []
try:
    while True:
        sender, receiver = socket.socketpair()
        sender.setblocking(False)
        try:
            while True:
                sender.send(b"x" * 65536)
        except BlockingIOError:  # its buffer is full: kernel memory no other limit counts
            pairs.append((sender, receiver))
except OSError as error:
    print(len(pairs), error.strerror)
"""


def test_open_files_bound_what_kernel_buffers_hold():
    result = run(FILL_SOCKET_BUFFERS, max_open_files=64)
    assert result.ok, result
    filled, reason = result.stdout.split(maxsplit=1)
    assert int(filled) < 32 and "Too many open files" in reason, result.stdout


FORK_BOMB = """
import os, time
children = []
try:
    while True:
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
except OSError:
    print(children)
    raise
"""


def assert_left_nothing(result: SandboxResult, pids: list[int]) -> None:
    """Nothing the program started still runs: its pid namespace is empty (strict
    isolation, where `pids` are numbers inside it), or each of `pids` has ended."""
    namespace = result.isolation.get("pid_namespace")
    if result.isolation.get("isolation") == "strict":
        assert namespace
        for entry in (entry for entry in os.listdir("/proc") if entry.isdigit()):
            with contextlib.suppress(OSError):
                assert os.readlink(f"/proc/{entry}/ns/pid") != namespace, f"{entry} still runs"
    else:
        for pid in pids:
            assert_ended(pid)


@pytest.mark.parametrize("isolation", ["strict", "basic"])
def test_fork_bomb_fails_at_the_process_limit_and_its_children_are_killed(isolation):
    result = run(FORK_BOMB, max_processes=6, timeout_s=10, isolation=isolation)
    assert result.status == "error", result
    assert result.isolation["isolation"] == isolation or isolation == "strict"
    assert "BlockingIOError" in result.stderr or "temporarily unavailable" in result.stderr
    children = eval(result.stdout)
    assert 0 < len(children) < 6  # the program itself counts as one
    assert result.wall_s < 5  # the sleeping children did not hold the run open
    assert_left_nothing(result, children)  # killed with the group, or with the namespace
    assert_host_can_spawn()


def test_endless_forking_loop_is_contained():
    result = run("import os\nwhile True:\n    os.fork()", max_processes=6, timeout_s=3)
    assert result.status in ("error", "timeout")
    assert "Resource temporarily unavailable" in result.stderr or result.status == "timeout"
    assert_host_can_spawn()


def test_flooding_stdout_is_stopped_with_the_output_truncated():
    result = run("import sys\nsys.stdout.write('x' * 10_000_000)", max_output_bytes=64 << 10)
    assert result.status == "output_limit", result
    assert result.stdout.startswith("x" * (64 << 10) + "\n[output truncated: 65536 of at least")
    assert len(result.stdout) < (64 << 10) + 100


def test_output_between_the_cap_and_the_hard_cap_is_truncated_not_stopped():
    result = run("print('y' * 100_000)", max_output_bytes=64 << 10)
    assert result.status == "ok"
    assert result.stdout.endswith("[output truncated: 65536 of 100001 bytes shown]")


def test_stdin_is_at_eof_unless_given():
    assert run("import sys\nprint(repr(sys.stdin.read()))").stdout == "''\n"
    assert run("print(input()[::-1])", stdin_text="abc\n").stdout == "cba\n"


def test_cwd_starts_empty_and_is_removed_afterwards():
    code = "import os\nprint(os.listdir('.'))\nopen('made.txt', 'w').write('x')\nprint(os.getcwd())"
    listing, cwd = run(code).stdout.splitlines()
    assert listing == "[]"
    assert not os.path.exists(cwd)
    assert not os.path.exists(os.path.dirname(cwd))


def test_environment_is_minimal():
    code = "import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated)"
    names, isolated = run(code).stdout.splitlines()
    assert "PYTHONPATH" not in names and "PATH" in names
    assert isolated == "1"


def test_as_root_the_program_runs_as_nobody_or_says_it_does_not():
    if os.geteuid() != 0:
        pytest.skip("runs as root only")
    result = run("import os\nprint(os.getuid(), os.getgid())")
    if result.isolation.get("user") == 65534:
        assert result.stdout == "65534 65534\n"
        assert not result.stderr
    else:
        assert result.stderr.startswith("[sandbox] not enforced here: max_processes")


def test_the_program_cannot_write_outside_its_directory():
    if os.geteuid() != 0 or sandbox_capabilities().get("user") != 65534:
        pytest.skip("needs the sandbox to drop root to nobody")
    result = run("open('/etc/hybridflow-sandbox-test', 'w')")
    assert "PermissionError" in result.stderr
    assert not os.path.exists("/etc/hybridflow-sandbox-test")


@pytest.fixture()
def listening_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    yield server
    server.close()


CONNECT = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    print("connected")
except OSError as error:
    print("refused:", error)
"""


def test_no_network_reaches_the_host(listening_server):
    if not network_isolation_available():
        notes = sandbox_capabilities().get("notes")
        pytest.skip(f"no network namespace on this machine: {notes}")
    port = listening_server.getsockname()[1]
    result = run(CONNECT.format(port=port))
    assert result.stdout.startswith("refused"), result
    with pytest.raises(socket.timeout):
        listening_server.accept()
    assert run(CONNECT.format(port=port), network=True).stdout == "connected\n"


@pytest.mark.parametrize("isolation", ["strict", "basic"])
def test_a_setsid_child_is_killed_with_the_run(isolation):
    if isolation == "basic" and not network_isolation_available():
        pytest.skip("escaped processes are found through the run's network namespace")
    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
        "    start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(child.pid)"
    )
    result = run(code, isolation=isolation)
    assert_left_nothing(result, [int(result.stdout)])


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = most = 0
    for _, change in events:  # at a tie an end sorts first: touching is not overlapping
        running += change
        most = max(most, running)
    return most


def test_concurrency_limits_programs_running_at_once():
    sandbox = Sandbox(SandboxLimits(concurrency=2, timeout_s=30))
    code = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())"

    async def four():
        return await asyncio.gather(*(sandbox.run(code) for _ in range(4)))

    results = asyncio.run(four())
    assert [r.status for r in results] == ["ok"] * 4
    intervals = [tuple(map(float, r.stdout.split())) for r in results]
    assert most_at_once(intervals) == 2  # two at a time: not four at once, nor one by one
    # The same Sandbox in a second event loop gets a semaphore of its own.
    assert asyncio.run(sandbox.run("print(2)")).stdout == "2\n"


def test_cancelling_a_run_kills_the_program_and_removes_its_directory():
    async def cancelled():
        task = asyncio.create_task(run_code("import os, time\nprint(os.getcwd(), flush=True)\n"
                                            "time.sleep(60)", SandboxLimits(timeout_s=30)))  # fmt: skip
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = set(os.listdir(tempfile.gettempdir()))
    started = time.monotonic()
    asyncio.run(cancelled())
    assert time.monotonic() - started < 3
    after = set(os.listdir(tempfile.gettempdir()))
    assert not [name for name in after - before if name.startswith("hybridflow-sandbox-")]


def test_run_code_sync_works_inside_a_running_loop():
    async def inside():
        return run_code_sync("print(3)")

    assert asyncio.run(inside()).stdout == "3\n"


@pytest.mark.parametrize(
    "returncode, stderr, wall_s, expected",
    [
        (-24, "", 1.0, "cpu_limit"),  # SIGXCPU
        (-9, "", 2.5, "cpu_limit"),  # SIGKILL at the hard CPU limit
        (-9, "", 0.1, "killed"),
        (1, "Traceback ...\nMemoryError\n", 0.1, "memory_limit"),
        (-11, "", 0.1, "killed"),
        (1, "ValueError: x\n", 0.1, "error"),
        (0, "MemoryError caught\n", 0.1, "ok"),
    ],
)
def test_classify(returncode, stderr, wall_s, expected):
    assert classify(returncode, stderr, wall_s, SandboxLimits(cpu_s=2))[0] == expected


def test_limits_are_checked():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=0)


def test_python_tool_answers_output_and_errors():
    tool = PythonTool(Sandbox(SandboxLimits(timeout_s=3)))
    assert openai_schema(tool)["function"]["parameters"]["required"] == ["code"]
    assert "No network" in tool.description
    assert asyncio.run(tool({"code": "print(6 * 7)"})) == "42"
    assert asyncio.run(tool({"code": "pass"})) == "(no output)"
    error = asyncio.run(tool({"code": "print('before')\n1 / 0"}))
    assert error.startswith("before\nTraceback") and error.endswith(
        "ZeroDivisionError: division by zero"
    )
    slow = asyncio.run(tool({"code": "import time\ntime.sleep(10)"}))
    assert slow == "TimeoutError: the program ran longer than 3 s"
    with pytest.raises(ToolError, match="missing required argument"):
        asyncio.run(tool({}))
