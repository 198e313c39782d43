"""Where an agent benchmark's time goes on the engine's side: wall time of the timed run of
`hybridflow bench agent`'s episodes, split into the scheduler's phases (admission of new and
continued requests, decode chunks, read-backs) and the time the engine's thread sat idle
waiting for requests; plus the submit calls on the episodes' thread.

    python dev/agent_timeline.py --preset qwen2.5-0.5b
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


def instrument(counts: collections.Counter, seconds: collections.defaultdict) -> None:
    from hybridflow.engine import scheduler, service

    def wrap(owner, name):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
                counts[name] += 1

        setattr(owner, name, timed)

    for name in ("step", "_admit", "_admit_extension", "_absorb", "_decode", "_retire",
                 "_snapshot"):  # fmt: skip
        wrap(scheduler.Scheduler, name)
    wrap(scheduler._Snapshot, "wait")
    wrap(service.RolloutService, "submit")
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
    args = parser.parse_args()

    from hybridflow.agents.bench import FixedScheduleEpisodes
    from hybridflow.agents.client import EngineClient
    from hybridflow.engine import Engine, SamplingParams
    from hybridflow.engine.bench_cli import make_prompts
    from hybridflow.models import load_model

    counts, seconds = collections.Counter(), collections.defaultdict(float)
    instrument(counts, seconds)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args.preset, dtype=dtype, device=device).eval()
    vocab = model.config.vocab_size
    prompts = make_prompts(args.episodes, 128, vocab, 0)
    length = 128 + args.turns * args.turn_tokens + (args.turns - 1) * args.tool_tokens
    engine = Engine(model, max_batch_size=args.episodes, max_seq_len=length)
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
    scheduler = engine.scheduler
    steps, rows = scheduler.decode_steps, scheduler.decoded_rows
    wall = agent_run()
    steps, rows = scheduler.decode_steps - steps, scheduler.decoded_rows - rows
    print(f"{args.preset} on {args.device}: wall {wall:.3f} s, {steps} decode steps, "
          f"{rows / max(steps, 1):.1f} rows per step")  # fmt: skip
    print("| phase | calls | seconds |\n|---|---|---|")
    for name in sorted(seconds, key=seconds.get, reverse=True):
        print(f"| {name} | {counts[name]} | {seconds[name]:.3f} |")


if __name__ == "__main__":
    main()
