"""Where a generate() call's wall time goes on the device: a torch.profiler trace of one warm
call, reduced to GPU busy time, GPU idle gaps, and which host phase (admission, decode
replays, collection) was running when each gap opened.

engine_step.py finds the replayed step a few percent shorter than a generate() call implies
(8% at 0.5b / 1024 rows); this names the difference.

    python dev/engine_timeline.py --preset qwen2.5-0.5b --rows 1024   # H200, ~1 min
    python dev/engine_timeline.py --device cpu --preset tiny --rows 4 --new-tokens 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

from hybridflow.bench.common import make_prompts, parse_engine_settings
from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.scheduling import scheduler
from hybridflow.models import load_model

# Host phases marked in the trace (record_function around these scheduler.Scheduler methods).
PHASES = ("_admit", "_decode", "_snapshot", "_absorb", "_retire")


def idle_gaps(kernels: list[tuple[float, float]], phases: list[tuple[str, float, float]],
              top: int = 15, ops: list[tuple[str, float, float]] = ()) -> dict:  # fmt: skip
    """kernels: (start, end) device intervals; phases: (name, start, end) host intervals on
    the same clock (us). Returns busy and idle time over the kernels' span, idle time by the
    host phase running when each gap opened ("other" outside every phase), and the largest
    gaps, each with the innermost host op (ops: (name, start, end)) running when it opened."""
    if not kernels:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "idle_by_phase": {},
                "largest": []}  # fmt: skip
    kernels = sorted(kernels)
    busy, gaps = 0.0, []
    cur_start, cur_end = kernels[0]
    for start, end in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((cur_end, start))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = cur_end - kernels[0][0]

    def phase_at(t: float, intervals=phases) -> str:
        inside = [(s, name) for name, s, e in intervals if s <= t <= e]
        return max(inside)[1] if inside else "other"  # the innermost (latest started)

    by_phase: dict[str, float] = {}
    described = []
    for start, end in gaps:
        name = phase_at(start)
        by_phase[name] = by_phase.get(name, 0.0) + (end - start)
        described.append({"at_us": start - kernels[0][0], "us": end - start, "phase": name})
    described.sort(key=lambda g: -g["us"])
    for gap in described[:top]:
        gap["host_op"] = phase_at(gap["at_us"] + kernels[0][0], ops)
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy,
            "idle_by_phase": dict(sorted(by_phase.items(), key=lambda kv: -kv[1])),
            "gaps": len(gaps), "largest": described[:top]}  # fmt: skip


def _trace_intervals(path: str) -> tuple[list, list, list, tuple, list, dict]:
    """Chrome trace -> kernel intervals, host phase intervals, host ops, generate()'s own
    (start, end), kernel records (name, start, duration, correlation) and each runtime call's
    start by correlation id (a graph replay's kernels carry its cudaGraphLaunch's id)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels, phases, ops, records, launches, call = [], [], [], [], {}, (0.0, 0.0)
    for event in events:
        if event.get("ph") != "X":
            continue
        start, end = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))
        cat, name = event.get("cat", ""), event.get("name", "")
        correlation = (event.get("args") or {}).get("correlation")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append((start, end))
            records.append((name, start, end - start, correlation))
        elif cat == "user_annotation" and name in PHASES:
            phases.append((name, start, end))
        elif cat == "user_annotation" and name == "generate":
            call = (start, end)
        elif cat in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function"):
            ops.append((name[:60], start, end))
            if cat in ("cuda_runtime", "cuda_driver") and correlation is not None:
                launches[correlation] = start
    return kernels, phases, ops, call, records, launches


def start_ops(ops, phases, call: tuple[float, float], least_us: float = 30.0) -> list[dict]:
    """The host's work between generate()'s start and its first admission (the GPU has only
    the weight refresh to run meanwhile): top-level host ops (not inside another listed op)
    of at least least_us, in order, with their start (us into the call) and length."""
    admits = [s for name, s, _ in phases if name == "_admit"]
    stop = min(admits) if admits else call[1]
    inside = sorted((s, e, n) for n, s, e in ops if call[0] <= s < stop)
    top, last_end = [], -1.0
    for s, e, n in inside:
        if s >= last_end:  # not nested in the previous top-level op
            top.append({"op": n, "at_us": round(s - call[0], 1), "us": round(e - s, 1)})
            last_end = e
    return [t for t in top if t["us"] >= least_us] + [
        {"op": "(first admission starts)", "at_us": round(stop - call[0], 1), "us": 0.0}
    ]


def kernels_by_phase(records, launches: dict, phases, top: int = 12) -> dict:
    """Device time of each kernel name, grouped by the host phase that launched it (the phase
    running when its runtime call started): {phase: {"us": total, "kernels": {name: us}}},
    the top kernels per phase. Prefill kernels are the ones _admit launched."""
    grouped: dict[str, dict[str, float]] = {}
    for name, start, duration, correlation in records:
        launched = launches.get(correlation, start)
        inside = [(s, p) for p, s, e in phases if s <= launched <= e]
        phase = max(inside)[1] if inside else "other"
        by_name = grouped.setdefault(phase, {})
        by_name[name[:70]] = by_name.get(name[:70], 0.0) + duration
    out = {}
    for phase, by_name in grouped.items():
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1])
        out[phase] = {"us": sum(by_name.values()),
                      "kernels": {n: round(us, 1) for n, us in ranked[:top]}}  # fmt: skip
    return out


def runtime_calls(ops, names=("cudaHostAlloc", "cudaFreeHost", "cudaStreamSynchronize",
                              "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                              "cudaMallocHost", "cudaHostRegister")) -> dict:  # fmt: skip
    """Count and total host time of the runtime calls that can stall the host (or allocate
    pinned memory) among the trace's host ops."""
    out: dict[str, dict] = {}
    for name, start, end in ops:
        if name.startswith(names):
            entry = out.setdefault(name, {"calls": 0, "us": 0.0})
            entry["calls"] += 1
            entry["us"] += end - start
    return out


def sync_points(engine, prompts, params) -> dict:
    """Lines that synchronised the host with the GPU during one generate() call
    (torch.cuda.set_sync_debug_mode: .item(), .tolist() on device tensors, pageable copies;
    event waits are not reported): {"file:line": count}."""
    import warnings

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    counts: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{os.path.relpath(w.filename)}:{w.lineno}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def _annotate(loop_class) -> None:
    """Wrap the loop's phase methods in record_function ranges (this process only)."""
    for name in PHASES:
        method = getattr(loop_class, name, None)
        if method is None or getattr(method, "_annotated", False):
            continue

        def wrapped(self, *args, _method=method, _name=name, **kwargs):
            with torch.profiler.record_function(_name):
                return _method(self, *args, **kwargs)

        wrapped._annotated = True
        setattr(loop_class, name, wrapped)


@torch.no_grad()
def timeline(preset: str, rows: int, length: int, new_tokens: int, device: torch.device,
             n: int = 1, options: EngineOptions | None = None) -> dict:  # fmt: skip
    """n > 1: rows // n prompts of n samples each (GRPO-shaped: the shared-prefix path)."""
    from torch.profiler import ProfilerActivity, profile

    if rows % n:
        raise ValueError(f"--rows {rows} is not a multiple of --n {n}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(preset, dtype=dtype, device=device).eval()
    eng = Engine(model, max_batch_size=rows, max_seq_len=length + new_tokens + 64,
                 options=options)  # fmt: skip
    prompts = make_prompts(rows // n, length, model.config.vocab_size, 0)
    params = SamplingParams(n=n, max_new_tokens=new_tokens, seed=0, ignore_eos=True)
    eng.generate(prompts, params)  # compile, tune, capture
    _annotate(scheduler.Scheduler)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    pauses: dict[str, list[float]] = {"unprofiled": [], "profiled": []}
    pauses_at: dict[str, list[tuple]] = {"unprofiled": [], "profiled": []}
    run = "unprofiled"
    began = [0.0]
    call_start = [0.0]

    def on_gc(phase, info):  # Python's collector stops the host (and a host-bound GPU)
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses[run].append(round((time.perf_counter() - began[0]) * 1e3, 3))
            # (ms into the call, generation collected): inside the loop means GC was not off
            pauses_at[run].append(
                (round((began[0] - call_start[0]) * 1e3, 2), info.get("generation"))
            )

    gc.callbacks.append(on_gc)
    start = call_start[0] = time.perf_counter()
    eng.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    unprofiled = time.perf_counter() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])  # fmt: skip
    run = "profiled"
    call_start[0] = time.perf_counter()
    with profile(activities=activities) as prof:
        with torch.profiler.record_function("generate"):
            eng.generate(prompts, params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    gc.callbacks.remove(on_gc)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        kernels, phases, ops, call, records, launches = _trace_intervals(path)
    call_us = call[1] - call[0]
    host_by_phase: dict[str, float] = {}
    for name, s, e in phases:
        host_by_phase[name] = host_by_phase.get(name, 0.0) + (e - s)
    result = idle_gaps(kernels, phases, ops=ops)
    result["gc_pauses_ms"] = pauses
    result["gc_pauses_at_ms"] = pauses_at
    result["kernels_by_phase"] = kernels_by_phase(records, launches, phases)
    result["runtime_calls"] = runtime_calls(ops)
    result["start_ops"] = start_ops(ops, phases, call)
    if device.type == "cuda":
        result["sync_points"] = sync_points(eng, prompts, params)
    result.update(preset=preset, rows=rows, length=length, new_tokens=new_tokens,
                  sync_lag=eng.sync_lag,
                  unprofiled_call_ms=unprofiled * 1e3, profiled_call_us=call_us,
                  host_by_phase_us=host_by_phase,
                  host_calls={n: sum(1 for p in phases if p[0] == n) for n in PHASES})  # fmt: skip
    return result


def main() -> None:
    from engine_step import add_case_arguments  # dev/ is the script's own folder

    parser = argparse.ArgumentParser()
    add_case_arguments(parser)
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                        help="an EngineOptions field, e.g. sync_lag=0 (repeatable)")  # fmt: skip
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (rows / n prompts)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    options = EngineOptions.from_dict(parse_engine_settings(args.engine)).checked()
    r = timeline(args.preset, args.rows, args.length, args.new_tokens, torch.device(args.device),
                 n=args.n, options=options)  # fmt: skip
    print(f"{r['preset']}, {r['rows']} rows, sync lag {r['sync_lag']}: "
          f"generate {r['unprofiled_call_ms']:.1f} ms "
          f"unprofiled, {r['profiled_call_us'] / 1e3:.1f} ms profiled; kernels span "
          f"{r['span_us'] / 1e3:.1f} ms, busy {r['busy_us'] / 1e3:.1f} ms, idle "
          f"{r['idle_us'] / 1e3:.2f} ms in {r.get('gaps', 0)} gaps")  # fmt: skip
    print("idle by host phase (us):", {k: round(v) for k, v in r["idle_by_phase"].items()})
    print("host time by phase (us):", {k: round(v) for k, v in r["host_by_phase_us"].items()},
          "calls:", r["host_calls"])  # fmt: skip
    for name, p in r["gc_pauses_ms"].items():
        print(f"GC pauses in the {name} call: {len(p)}, {sum(p):.1f} ms in all, max "
              f"{max(p, default=0):.1f} ms")  # fmt: skip
    print("GC pauses (ms into the call, generation):", r["gc_pauses_at_ms"])
    print("runtime calls:", r["runtime_calls"])
    if "sync_points" in r:
        print("host syncs in one generate():", r["sync_points"] or "none")
    for phase, entry in r["kernels_by_phase"].items():
        print(f"kernels launched in {phase}: {entry['us'] / 1e3:.1f} ms")
        for name, us in entry["kernels"].items():
            print(f"    {us / 1e3:8.2f} ms  {name}")
    print("host ops before the first admission (us into the call, us):")
    for op in r["start_ops"]:
        print(f"  {op['at_us'] / 1e3:8.2f} ms {op['us']:9.1f} us  {op['op']}")
    for gap in r["largest"]:
        print(f"  gap {gap['us']:8.1f} us at {gap['at_us'] / 1e3:8.2f} ms during {gap['phase']}"
              f" / {gap['host_op']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
