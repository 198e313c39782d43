"""The profiler role: each worker process (local backend) writes its own torch trace."""

import json

import torch

from hybridflow.controller import Dispatch, ResourcePool, Worker, WorkerGroup, fuse, register
from hybridflow.workers import ProfilerWorker


class Square(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def square(self, size: int) -> float:
        x = torch.randn(size, size)
        return float((x @ x).sum())


def test_a_worker_process_writes_a_trace_named_by_role_and_rank(tmp_path):
    fused = fuse(square=Square, profiler=ProfilerWorker)
    with WorkerGroup(fused, ResourcePool(cpus=1), "local", call_timeout_s=60) as group:
        group.profiler.start_profile("torch", str(tmp_path))
        group.square.square(32)
        paths = group.profiler.stop_profile()
        group.square.square(32)  # after the stop: in no trace
    assert paths == [str(tmp_path / "square-rank0.json")]  # one process start: ~4 s
    for path in paths:
        names = [e.get("name") for e in json.loads(open(path).read())["traceEvents"]]
        assert names.count("square.square") == 1  # the worker call's range
        assert "aten::mm" in names


def test_a_profiled_process_prints_nothing_of_its_own(tmp_path):
    # kineto's "USDT: ... profiler_start" lines once fell between the step table's rows
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from hybridflow.workers.profiler import ProcessProfile\n"
        "session = ProcessProfile('torch')\n"
        "torch.ones(8).sum()\n"
        f"session.stop({str(tmp_path / 'trace.json')!r})\n"
    )
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("KINETO_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout + done.stderr == ""
    assert (tmp_path / "trace.json").is_file()
