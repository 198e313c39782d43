"""``trainer.profile``: profile chosen RL steps (options: trainer/observe/profile_options.py).

For each step in ``trainer.profile.steps`` the controller and every worker rank profile
themselves from the step's start to its end (hybridflow/workers/profiler.py). With
``tool=torch`` each process writes a Chrome trace under ``<run_dir>/profile/step_<N>/``:
``controller.json`` (the stages as ``stage/<name>`` ranges; with the in-process backend the
workers' threads too) and ``<roles>-rank<r>.json`` for each worker process. At the end of
the run :meth:`StepProfiler.summary` lists the top kernels of each stage. With ``tool=nvtx``
the same ranges become NVTX ranges for Nsight Systems.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from hybridflow.trainer.observe.profile_options import ProfileOptions

CONTROLLER_TRACE = "controller.json"


class ProfilerHandle(Protocol):
    """A group's ``profiler`` role: :class:`hybridflow.workers.profiler.ProfilerWorker`."""

    def start_profile(self, tool: str, directory: str, record_shapes: bool = False) -> list:
        """Start profiling every rank: ``ProfilerWorker.start_profile``."""
        ...

    def stop_profile(self) -> list[str | None]:
        """Stop; each rank's trace path: ``ProfilerWorker.stop_profile``."""
        ...


class StepProfiler:
    """Profiles the steps ``options.steps`` of a run; ``stage(name)`` names a stage's range."""

    def __init__(
        self,
        options: ProfileOptions,
        run_dir: str | Path,
        workers: Sequence[ProfilerHandle] = (),
        use_cuda: bool = False,
    ):
        self.options, self.workers, self.use_cuda = options, list(workers), use_cuda
        self.directory = Path(run_dir) / "profile"
        self.traces: dict[int, list[Path]] = {}
        self._profiling = False

    def wants(self, step: int) -> bool:
        return step in self.options.steps

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Profile the block (one RL step) when ``step`` is one of the chosen steps."""
        if not self.wants(step):
            yield
            return
        from hybridflow.workers.profiler import ProcessProfile

        o = self.options
        directory = self.directory / f"step_{step}"
        directory.mkdir(parents=True, exist_ok=True)
        for group in self.workers:
            group.start_profile(o.tool, str(directory), o.record_shapes)
        profile = ProcessProfile(o.tool, record_shapes=o.record_shapes, use_cuda=self.use_cuda)
        self._profiling = True
        try:
            yield
        finally:
            self._profiling = False
            written = [profile.stop(directory / CONTROLLER_TRACE)]
            for group in self.workers:
                written += group.stop_profile()
            self.traces[step] = [Path(p) for p in written if p is not None]

    def stage(self, name: str):
        """A ``stage/<name>`` range while a step is profiled; nothing otherwise."""
        if not self._profiling:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(f"stage/{name}")

    def summary(self) -> str:
        """The top kernels (ops on the CPU) per stage of each trace written; '' if none."""
        from hybridflow.trainer.observe.trace_summary import (
            format_summary,
            load_events,
            top_by_region,
        )

        if self.options.tool != "torch" or not self.traces:
            return ""
        lines = [f"profile: traces in {self.directory} (open them in https://ui.perfetto.dev)"]
        for step, paths in sorted(self.traces.items()):
            lines.append(f" step {step}")
            for path in paths:
                kind, table = top_by_region(load_events(path), self.options.top_k)
                lines += format_summary(path.name, kind, table)
        return "\n".join(lines)


def build_profiler(cfg, roles) -> StepProfiler | None:
    """The run's profiler, or None when ``trainer.profile.steps`` is empty."""
    options: ProfileOptions = cfg.trainer.profile
    if not options.steps:
        return None
    import torch

    # The controller records CUDA activity only when it runs the workers (in-process on a
    # GPU); elsewhere it never touches a GPU (trainer/observe/metrics.py, cuda_device_name).
    use_cuda = cfg.trainer.backend == "inprocess" and torch.cuda.is_available()
    return StepProfiler(options, cfg.trainer.run_dir, roles.profilers, use_cuda=use_cuda)
