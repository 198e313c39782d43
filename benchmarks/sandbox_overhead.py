"""`python benchmarks/sandbox_overhead.py`: what one program costs in the code sandbox, per isolation.

    python benchmarks/sandbox_overhead.py [--programs 100] [--concurrency 8] [--code "pass"]

For each isolation ("basic": own directory and limits; "strict": a jail per program), runs
`--programs` programs one after another, then `--programs` with `--concurrency` at once (as
the code reward and agent rollouts do), and prints per program: the median and fastest wall
time (start of the interpreter to the result, one at a time), the CPU time of the sandbox's
processes (user + system, from the kernel's accounting of reaped children: unlike wall time,
hardly affected by other load on the machine), and the throughput at `--concurrency`. The
last column is strict's extra wall time over basic: the median of the differences between
runs made back to back (the levels take turns), so that the machine's load cancels.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time

from hybridflow.agents.sandbox import Sandbox, SandboxLimits, jail_unavailable, run_code_sync


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_at_a_time(code: str, limits: dict[str, SandboxLimits], programs: int) -> dict:
    """Per isolation: the wall seconds of each run and the CPU seconds per run of the
    sandbox's processes. The levels take turns, run by run, so that a change in the
    machine's load reaches them alike; the differences are paired run by run."""
    walls: dict[str, list[float]] = {level: [] for level in limits}
    cpu_s = dict.fromkeys(limits, 0.0)
    for _ in range(programs):
        for level, level_limits in limits.items():
            cpu_before, started = children_cpu_s(), time.perf_counter()
            result = run_code_sync(code, level_limits)
            walls[level].append(time.perf_counter() - started)
            cpu_s[level] += children_cpu_s() - cpu_before
            if not result.ok:
                sys.exit(f"the program failed under {level} isolation: {result}")
    return {level: (walls[level], cpu_s[level] / programs) for level in limits}


def at_once(code: str, limits: SandboxLimits, programs: int) -> float:
    """Programs per second with `limits.concurrency` running at a time."""
    sandbox = Sandbox(limits)

    async def run_all():
        return await asyncio.gather(*(sandbox.run(code) for _ in range(programs)))

    started = time.perf_counter()
    results = asyncio.run(run_all())
    elapsed = time.perf_counter() - started
    failed = [result for result in results if not result.ok]
    if failed:
        sys.exit(f"a program failed under {limits.isolation} isolation: {failed[0]}")
    return programs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=100, help="programs per measurement (100)")
    parser.add_argument("--concurrency", type=int, default=8, help="programs at once (8)")
    parser.add_argument("--code", default="pass", help='the program ("pass")')
    args = parser.parse_args()
    why = jail_unavailable()
    levels = ["basic"] + ([] if why else ["strict"])
    print(f"host: {os.uname().sysname} {os.uname().release}, {os.cpu_count()} CPUs, "
          f"uid {os.geteuid()}, load {os.getloadavg()[0]:.1f}; program: {args.code!r}")  # fmt: skip
    if why:
        print(f"strict isolation is not possible here: {why}")
    limits = {level: SandboxLimits(isolation=level, concurrency=args.concurrency)
              for level in levels}  # fmt: skip
    for level_limits in limits.values():
        run_code_sync(args.code, level_limits)  # warm: page cache, the strict probe
    measured = one_at_a_time(args.code, limits, args.programs)
    basic_walls = measured["basic"][0]
    rows = {}
    for level, (walls, cpu_s) in measured.items():
        extra = statistics.median(w - b for w, b in zip(walls, basic_walls))
        rate = at_once(args.code, limits[level], args.programs)
        rows[level] = (statistics.median(walls), min(walls), cpu_s, rate, extra)
    print(f"{'isolation':<10}{'median ms':>11}{'fastest ms':>12}{'cpu ms':>9}"
          f"{'programs/s':>12}{'+ms vs basic':>14}")  # fmt: skip
    print("-" * 68)
    for level, (median_s, fastest_s, cpu_s, rate, extra_s) in rows.items():
        extra = extra_s * 1000
        print(f"{level:<10}{median_s * 1000:>11.1f}{fastest_s * 1000:>12.1f}{cpu_s * 1000:>9.1f}"
              f"{rate:>12.1f}{extra:>+14.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
