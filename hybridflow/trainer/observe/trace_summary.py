"""What a profile says, from its Chrome trace files: the top kernels of each stage.

Pure functions over the trace's complete events (``ph == "X"``: ``name``, ``cat``, ``ts`` and
``dur`` in µs, ``tid``). Regions are the trainer's stage ranges (``stage/gen``, …) where the
trace has them (the controller's), else the worker-call ranges (``rollout.generate``,
``actor.update``, …) of a worker process. Each kernel is charged to the innermost region
whose time window holds its start: the stage timer synchronises the device at stage
boundaries, so a stage's kernels run inside its window. A trace without GPU kernels (a CPU
run) ranks ops by self time (their time minus that of the ops they call).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

STAGE_PREFIX = "stage/"
KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
NAME_WIDTH = 70  # CUDA kernel names run to hundreds of characters (templates)


def load_events(path: str | Path) -> list[dict]:
    """The complete (``"X"``) events of a Chrome trace file."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def regions(events: Iterable[dict]) -> list[tuple[str, float, float]]:
    """(name, start, end) of the stage ranges, or of the worker-call ranges if none."""
    annotations = [e for e in events if e.get("cat") == "user_annotation"]
    stages = [e for e in annotations if e["name"].startswith(STAGE_PREFIX)]
    chosen = stages or [e for e in annotations if "." in e["name"]]
    return [
        (e["name"].removeprefix(STAGE_PREFIX), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in chosen
    ]


def self_times(ops: Sequence[dict]) -> list[tuple[str, float, float]]:
    """(name, start, self µs) of CPU ops: each op's duration minus its direct children's on
    the same thread (ops nest like a call stack)."""
    result = []
    by_thread: dict[object, list[dict]] = defaultdict(list)
    for op in ops:
        by_thread[op.get("tid")].append(op)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list] = []  # [name, start, end, children µs]
        for op in thread_ops:
            start, dur = float(op["ts"]), float(op["dur"])
            while stack and start >= stack[-1][2]:
                name, s, e, children = stack.pop()
                result.append((name, s, (e - s) - children))
            if stack:
                stack[-1][3] += dur
            stack.append([op["name"], start, start + dur, 0.0])
        while stack:
            name, s, e, children = stack.pop()
            result.append((name, s, (e - s) - children))
    return result


def top_by_region(events: Sequence[dict], top_k: int) -> tuple[str, dict[str, list]]:
    """("kernels" | "ops", {region: [(name, µs), ...] the ``top_k`` largest, region total
    first as ("total", µs)}); regions in order of first appearance."""
    kernels = [e for e in events if e.get("cat") in KERNEL_CATEGORIES]
    if kernels:
        kind, items = "kernels", [(e["name"], float(e["ts"]), float(e["dur"])) for e in kernels]
    else:
        kind = "ops"
        items = self_times([e for e in events if e.get("cat") == "cpu_op"])
    windows = sorted(regions(events), key=lambda r: r[1])
    sums: dict[str, dict[str, float]] = {name: defaultdict(float) for name, _, _ in windows}
    for name, start, micros in items:
        inside = [w for w in windows if w[1] <= start < w[2]]
        if inside:
            region = min(inside, key=lambda w: w[2] - w[1])[0]
            sums[region][name] += micros
    table = {}
    for region, per_name in sums.items():
        if per_name:
            ranked = sorted(per_name.items(), key=lambda item: -item[1])
            table[region] = [("total", sum(per_name.values())), *ranked[:top_k]]
    return kind, table


def format_summary(name: str, kind: str, table: dict[str, list]) -> list[str]:
    """Lines for one trace: each region's total, then its top entries (time, share, name)."""
    if not table:
        return [f"  {name}: no stage or worker-call ranges"]
    what = "kernels" if kind == "kernels" else "ops by self time (no GPU kernels)"
    lines = [f"  {name}: top {what} per stage"]
    for region, ((_, total), *top) in table.items():
        lines.append(f"    {region:<16} {_ms(total):>11}")
        for op, micros in top:
            share = 100 * micros / total if total else 0.0
            label = op if len(op) <= NAME_WIDTH else op[: NAME_WIDTH - 1] + "…"
            lines.append(f"      {_ms(micros):>11} {share:4.0f}%  {label}")
    return lines


def _ms(micros: float) -> str:
    return f"{micros / 1000:.1f} ms"
