"""Profiling one process: the torch profiler or NVTX ranges, and the role that does it in
every worker process (``fuse(..., profiler=ProfilerWorker)``).

The trainer (hybridflow/trainer/observe/profiling.py) starts a session in the controller and, through
this role, in every worker rank at the start of a profiled step, and stops them at its end.
Every worker call runs inside a ``record_function`` range named by its path
(controller/worker.py), so the trace shows which call each kernel belongs to.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridflow.controller import Dispatch, Worker, register

QUIET_KINETO_LOG_LEVEL = "6"
"""Above every level of kineto's logger (VERBOSE 0 … USDT 5): it prints nothing. A user's
own KINETO_LOG_LEVEL is kept."""


class ProcessProfile:
    """One profiling session of this process (``tool``: ``"torch"`` or ``"nvtx"``).

    torch: ``torch.profiler`` over every thread of the process (CPU, plus CUDA when this
    process uses a GPU), exported as Chrome trace JSON by :meth:`stop`. nvtx: ``emit_nvtx``
    on this thread (every ``record_function`` range and op becomes an NVTX range) and
    ``cudaProfilerStart``/``Stop`` for ``nsys --capture-range=cudaProfilerApi``.
    """

    def __init__(self, tool: str, *, record_shapes: bool = False, use_cuda: bool = False):
        import torch

        self.tool = tool
        if tool == "torch":
            from torch.profiler import ProfilerActivity, profile

            # kineto writes "USDT: ... profiler_start/stop" lines to stderr, between the step
            # table's rows, at every level up to its highest (5); read at its first start
            os.environ.setdefault("KINETO_LOG_LEVEL", QUIET_KINETO_LOG_LEVEL)

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
            self._session = profile(
                activities=activities,
                record_shapes=record_shapes,
                experimental_config=_all_threads_config(),
            )
        else:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "trainer.profile.tool=nvtx needs a CUDA build of torch and a GPU; "
                    "use trainer.profile.tool=torch on this machine"
                )
            self._session = torch.autograd.profiler.emit_nvtx(record_shapes=record_shapes)
        self._session.__enter__()
        if tool == "nvtx":
            torch.cuda.profiler.start()

    def stop(self, trace_path: str | Path | None) -> str | None:
        """End the session; torch: write the trace to ``trace_path`` and return it."""
        if self.tool == "nvtx":
            import torch

            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        self._session.__exit__(None, None, None)
        if self.tool != "torch" or trace_path is None:
            return None
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        self._session.export_chrome_trace(str(trace_path))
        return str(trace_path)


def _all_threads_config():
    """The torch profiler records only the thread that started it unless told otherwise; the
    in-process workers run on threads of their own (controller/inprocess.py)."""
    from torch.profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: the starting thread only
        return None


class ProfilerWorker(Worker):
    """The ``profiler`` role of a fused worker: profiles its process when asked."""

    def __init__(self, **_unused):
        self._profile: ProcessProfile | None = None
        self._trace: Path | None = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def start_profile(self, tool: str, directory: str, record_shapes: bool = False) -> None:
        """Start profiling this rank. In-process workers are threads of the controller, whose
        own torch profile records them; they start only NVTX (per thread)."""
        if tool == "torch" and self.context.backend == "inprocess":
            return
        roles = "+".join(name for name in self.context.colocated if name != "profiler")
        self._trace = Path(directory) / f"{roles or self.context.group}-rank{self.rank}.json"
        use_cuda = self.device.startswith("cuda")
        self._profile = ProcessProfile(tool, record_shapes=record_shapes, use_cuda=use_cuda)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> str | None:
        """Stop; the path of the trace this rank wrote (None: none written)."""
        if self._profile is None:
            return None
        profile, self._profile = self._profile, None
        return profile.stop(self._trace)
