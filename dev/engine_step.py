"""Anatomy of one decode step: where the time between two sampled tokens goes.

Times, as CUDA-graph replays of the engine's own code at `rows` live rows of length + new/2
cached tokens (the mean over a generate() call: attention time grows with it): the whole step (forward, lm_head, sampler, state update: what generate() replays),
the forward with lm_head, lm_head alone and the sampler alone; next to the step time a
generate() call implies ((wall - TTFT) / decode steps, each the best of 3 calls), whose
excess over the replayed step is host time (syncs, bookkeeping) and gaps between graph launches.

    python dev/engine_step.py --preset qwen2.5-0.5b --rows 256 --length 256
    python dev/engine_step.py --preset qwen2.5-1.5b --rows 256 --engine decode_layer=split
    python dev/engine_step.py --device cpu --preset tiny --rows 4 --length 16  # dry run

Then the top kernels of the replayed step (torch.profiler over graph replays, per step).
On CPU every part is timed eagerly (no graphs): only the code paths are exercised.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hybridflow.bench.common import make_prompts, parse_engine_settings
from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.models import load_model


def time_us(fn, device: torch.device, calls: int = 10) -> float:
    if device.type == "cuda":
        from hybridflow.engine.kernels.gemm import graph_time_us

        return graph_time_us(fn, calls=calls)
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device: torch.device, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls of fn: a call slowed by something else on the host
    does not count (one slow TTFT made wall - TTFT negative on a loaded CPU)."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def kernel_table(fn, device: torch.device, steps: int = 10, top: int = 25) -> list[dict]:
    """Per-kernel device time of fn (one decode step) under torch.profiler, per step: on CUDA
    fn is captured as a graph and replayed `steps` times (the kernels the engine replays);
    on CPU the ops' own CPU time of eager calls."""
    from torch.profiler import ProfilerActivity, profile

    run, activity = fn, ProfilerActivity.CPU
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        run, activity = graph.replay, ProfilerActivity.CUDA
    run()
    sync(device)
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            run()
        sync(device)
    rows = []
    for event in prof.key_averages():
        us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": event.key[:70], "calls_per_step": event.count / steps,
                         "us_per_step": us / steps})  # fmt: skip
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def live_rows(engine, rows: int, length: int) -> None:
    """Replace the engine's decode rows by `rows` live rows at `length` cached positions that
    never finish (the cache holds stale K/V of the last call there: values do not change the
    time), in slots 0..rows-1."""
    state, device = engine.state, engine.device
    state.keep_rows([])
    arange = torch.arange(rows, device=device)
    state.append_rows(
        arange % engine.config.vocab_size, torch.zeros(rows, device=device),
        torch.full_like(arange, length), arange, torch.full_like(arange, 1 << 20), arange, arange,
    )  # fmt: skip


@torch.no_grad()
def anatomy(
    preset: str,
    rows: int,
    length: int,
    new_tokens: int,
    device: torch.device,
    kernels: int = 25,
    options: EngineOptions | None = None,
) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(preset, dtype=dtype, device=device).eval()
    vocab = model.config.vocab_size
    engine = Engine(model, max_batch_size=rows, max_seq_len=length + new_tokens + 64,
                    options=options)  # fmt: skip
    prompts = make_prompts(rows, length, vocab, 0)
    params = SamplingParams(max_new_tokens=new_tokens, seed=0, ignore_eos=True)
    # generate() as the rollout benchmark times it: warm-up, TTFT, then the timed call
    engine.generate(prompts, params)
    first_token = SamplingParams(max_new_tokens=1, seed=1, ignore_eos=True)
    ttft = best_seconds(lambda: engine.generate(prompts, first_token), device)
    wall = best_seconds(lambda: engine.generate(prompts, params), device)
    implied_step_us = (wall - ttft) / max(new_tokens - 1, 1) * 1e6

    mean_length = length + new_tokens // 2
    state, runner, cache = engine.state, engine.runner, engine.cache
    live_rows(engine, rows, mean_length)
    # Marked finished, so the timed replays do the same work without moving the rows on
    # (a live row would gain a cached token per replay: ~40 over the measurements).
    state.finished[:rows] = True
    max_len = cache.max_seq_len
    parts = {}
    parts["step (graph the engine replays)"] = time_us(lambda: runner._step(rows, max_len), device)

    def forward():
        return runner.decode_forward(
            model, cache, engine.rope, state.tokens[:rows], state.positions[:rows],
            state.row_slots[:rows], max_len,
        )  # fmt: skip

    parts["forward + lm_head"] = time_us(forward, device)
    hidden = torch.randn(rows, model.config.hidden_size, dtype=dtype, device=device)
    parts["lm_head"] = time_us(lambda: model.lm_head(hidden), device)
    logits = model.lm_head(hidden)
    generated = state.generated[:rows].clone()
    parts["sampler"] = time_us(
        lambda: runner.sample(logits, state.seed_lo[:rows], state.seed_hi[:rows], generated),
        device,
    )
    step = parts["step (graph the engine replays)"]
    parts["generate() per step (wall - TTFT)"] = implied_step_us
    table = (
        kernel_table(lambda: runner._step(rows, max_len), device, top=kernels) if kernels else []
    )
    return {
        "preset": preset, "rows": rows, "length": length, "cached_tokens": mean_length,
        "live_positions": state.positions[:rows].tolist(), "device": str(device),
        "decode_layers": {str(k): v for k, v in engine.chooser.decisions.items()}
        if engine.chooser else None, "ttft_ms": ttft * 1e3,
        "tokens_per_s": rows * new_tokens / wall, "parts_us": parts, "kernels": table,
        "host_and_gaps_us": implied_step_us - step,
    }  # fmt: skip


def add_case_arguments(parser: argparse.ArgumentParser) -> None:
    """The decode case (model, rows, lengths, device); engine_timeline.py takes the same."""
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--length", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def main() -> None:
    parser = argparse.ArgumentParser()
    add_case_arguments(parser)
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                        help="an EngineOptions field (repeatable)")  # fmt: skip
    parser.add_argument("--kernels", type=int, default=25,
                        help="print the top N kernels of the replayed step (0: none)")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    options = EngineOptions.from_dict(parse_engine_settings(args.engine)).checked()
    result = anatomy(args.preset, args.rows, args.length, args.new_tokens,
                     torch.device(args.device), args.kernels, options)  # fmt: skip
    step = result["parts_us"]["step (graph the engine replays)"]
    print(f"{result['preset']}, {result['rows']} rows, {result['length']} prompt tokens, "
          f"{result['device']}: {result['tokens_per_s']:,.0f} tok/s, TTFT "
          f"{result['ttft_ms']:.1f} ms, decode layers {result['decode_layers']}")  # fmt: skip
    print("| part | us | / step |\n|---|---|---|")
    for name, us in result["parts_us"].items():
        print(f"| {name} | {us:,.1f} | {us / step:.2f} |")
    print(f"| host + gaps (generate - replayed step) | {result['host_and_gaps_us']:,.1f} | "
          f"{result['host_and_gaps_us'] / step:.2f} |")  # fmt: skip
    if result["kernels"]:
        print("\n| kernel (replayed step) | calls / step | us / step |\n|---|---|---|")
        for row in result["kernels"]:
            print(f"| {row['kernel']} | {row['calls_per_step']:.0f} | {row['us_per_step']:,.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
