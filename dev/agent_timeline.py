"""Where an agent benchmark's time goes on the engine's side: wall time of the timed run of
`hybridflow bench agent`'s episodes, split into the scheduler's phases (admission of new and
continued requests, decode chunks, read-backs) and the time the engine's thread sat idle
waiting for requests; plus the submit calls on the episodes' thread.

    python dev/agent_timeline.py --preset qwen2.5-0.5b [--engine max_prefill_tokens_per_step=2048]
    python dev/agent_timeline.py --preset tiny --device cpu --episodes 64   # dry run

Wrappers time each method (a few microseconds each), so the phases add up to about the wall
time of the engine's thread. A phase far above its share of the decode work is the clue: an
H200 run showed 3.67 s of 4.26 s in 14 extend passes, which were timing kernel candidates at
each new token count (docs/engine.md, Rollout service).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import threading
import time

import torch


def instrument(counts: collections.Counter, seconds: collections.defaultdict,
               events: list) -> None:  # fmt: skip
    from hybridflow.engine.scheduling import admission, continuation, mixed, readback, scheduler
    from hybridflow.engine.serving import service

    def wrap(owner, name, label=None):
        original = getattr(owner, name)
        label = label or name

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter()
                seconds[label] += end - start
                counts[label] += 1
                if name == "step":  # (start, end, live rows after it)
                    events.append((start, end, len(args[0].rows)))

        setattr(owner, name, timed)

    for name in ("step", "_absorb", "_decode", "retire", "_snapshot"):
        wrap(scheduler.Scheduler, name)
    # module functions the scheduler calls through their module: prefill, extend, mixed steps
    for module, name, label in ((admission, "admit", "prefill pass"),
                                (continuation, "admit", "extend pass"),
                                (mixed, "run_step", "mixed step")):  # fmt: skip
        wrap(module, name, label)
    wrap(readback.Snapshot, "wait")
    wrap(service.RolloutService, "submit_many")
    condition_wait = threading.Condition.wait

    def wait(self, timeout=None):
        start = time.perf_counter()
        try:
            return condition_wait(self, timeout)
        finally:
            if threading.current_thread().name == "hybridflow-engine":
                seconds["engine idle"] += time.perf_counter() - start
                counts["engine idle"] += 1

    threading.Condition.wait = wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--tool-tokens", type=int, default=32)
    parser.add_argument("--tool-latency-ms", type=float, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                        help="an EngineOptions field (repeatable)")  # fmt: skip
    parser.add_argument("--torch-profile", action="store_true",
                        help="also profile the timed run: top ops by device and host time")  # fmt: skip
    args = parser.parse_args()

    from hybridflow.agents.client import EngineClient
    from hybridflow.bench.agent import FixedScheduleEpisodes
    from hybridflow.bench.common import make_prompts
    from hybridflow.engine import Engine, SamplingParams
    from hybridflow.models import load_model

    counts, seconds, events = collections.Counter(), collections.defaultdict(float), []
    instrument(counts, seconds, events)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args.preset, dtype=dtype, device=device).eval()
    vocab = model.config.vocab_size
    prompts = make_prompts(args.episodes, 128, vocab, 0)
    length = 128 + args.turns * args.turn_tokens + (args.turns - 1) * args.tool_tokens
    from hybridflow.bench.agent import SimpleArgs
    from hybridflow.bench.common import engine_options

    engine = Engine(model, max_batch_size=args.episodes, max_seq_len=length,
                    options=engine_options(SimpleArgs(args.engine)))  # fmt: skip
    sampling = SamplingParams(temperature=1.0, ignore_eos=True)
    engine.warm_up(sampling)

    def agent_run() -> float:
        episodes = FixedScheduleEpisodes(args.turns, args.turn_tokens, args.tool_tokens,
                                         args.tool_latency_ms / 1000, vocab, sampling)  # fmt: skip
        client = EngineClient(engine)

        async def everything():
            await asyncio.gather(*(episodes.run(p, client, 1000 * i)
                                   for i, p in enumerate(prompts)))  # fmt: skip

        start = time.perf_counter()
        asyncio.run(everything())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        client.close()
        return time.perf_counter() - start

    agent_run()  # warm-up: compile, tune
    counts.clear()
    seconds.clear()
    events.clear()
    scheduler = engine.scheduler
    steps, rows = scheduler.decode_steps, scheduler.decoded_rows
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                               else [])  # fmt: skip
        with profile(activities=activities) as prof:
            wall = agent_run()
        averages = prof.key_averages()
        if device.type == "cuda":
            print(
                averages.table(
                    sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60
                )
            )
        print(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    else:
        wall = agent_run()
    steps, rows = scheduler.decode_steps - steps, scheduler.decoded_rows - rows
    print(f"{args.preset} on {args.device}: wall {wall:.3f} s, {steps} decode steps, "
          f"{rows / max(steps, 1):.1f} rows per step")  # fmt: skip
    print("| phase | calls | seconds |\n|---|---|---|")
    for name in sorted(seconds, key=seconds.get, reverse=True):
        print(f"| {name} | {counts[name]} | {seconds[name]:.3f} |")
    print_steps(events)


def print_steps(events: list) -> None:
    """The engine thread's steps as runs of one live-row count, with the gaps between steps
    (the engine idle, or busy outside step(): taking submissions)."""
    if not events:
        return
    origin = events[0][0]
    print("| from ms | to ms | steps | live rows after | gap before ms |\n|---|---|---|---|---|")
    run_start, run_rows, run_steps, gap, last_end = events[0][0], events[0][2], 0, 0.0, None
    for start, end, rows in events:
        before = 0.0 if last_end is None else start - last_end
        if rows != run_rows or before > 1e-3:
            print(f"| {(run_start - origin) * 1e3:.1f} | {(last_end - origin) * 1e3:.1f} | "
                  f"{run_steps} | {run_rows} | {gap * 1e3:.1f} |")  # fmt: skip
            run_start, run_rows, run_steps, gap = start, rows, 0, before
        run_steps += 1
        last_end = end
    print(f"| {(run_start - origin) * 1e3:.1f} | {(last_end - origin) * 1e3:.1f} | {run_steps} | "
          f"{run_rows} | {gap * 1e3:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
