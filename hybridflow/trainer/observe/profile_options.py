"""ProfileOptions: the config section ``trainer.profile.*`` (a plain dataclass: the config
loads it without torch). The profiler itself is hybridflow/trainer/observe/profiling.py."""

from __future__ import annotations

from dataclasses import dataclass, field

PROFILE_TOOLS = ("torch", "nvtx")


@dataclass(frozen=True)
class ProfileOptions:
    steps: list[int] = field(default_factory=list)
    """RL steps to profile, e.g. [2, 3]; []: off. Step 1 pays one-time costs (compilation,
    first allocations, kernel choices), so profile a later one to see the steady state."""
    tool: str = "torch"
    """torch: a torch.profiler trace (Chrome trace JSON, open in Perfetto or
    chrome://tracing) per process and step under <run_dir>/profile/step_<N>/ (the controller,
    with in-process workers, and each worker rank of every group), and a summary of the top
    kernels per stage printed at the end. nvtx: NVTX ranges for every stage, worker call and
    op, and cudaProfilerStart/Stop around the profiled steps, for
    `nsys profile --capture-range=cudaProfilerApi hybridflow train ...` (CUDA only)."""
    top_k: int = 5
    """Kernels (ops, on the CPU) listed per stage in the summary."""
    record_shapes: bool = False
    """torch: record the input shapes of every op (larger traces)."""

    def validate(self, total_steps: int) -> list[str]:
        problems = []
        if self.tool not in PROFILE_TOOLS:
            problems.append(f"tool={self.tool!r}: use one of {PROFILE_TOOLS}")
        bad = [s for s in self.steps if not isinstance(s, int) or not 1 <= s <= total_steps]
        if bad:
            problems.append(
                f"steps={self.steps}: {bad} not RL steps of this run; give steps in "
                f"1..trainer.total_steps={total_steps}, e.g. [2]"
            )
        if self.top_k < 1:
            problems.append(f"top_k={self.top_k}: must be >= 1")
        return problems
