"""`hybridflow bench ttft`: time to first token of a request that arrives into a full batch.

    hybridflow bench ttft --preset qwen2.5-0.5b --rows 255 --prompt-len 2048 --arrivals 8 \
        [--engine max_prefill_tokens_per_step=2048]

`rows` requests decode through the rollout service (long budgets, so the batch stays full);
then, one at a time, `arrivals` requests of `prompt-len` tokens arrive into it, each with one
token to generate, and the time from submit to its result is taken (its time to first
token). Beside it, what the target is made of: the batch's decode step (wall time over the
steps the scheduler ran meanwhile) and the prompt's prefill alone on the idle engine. The
target (docs/performance.md): TTFT ≤ its own prefill + 2 decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import time


def add_ttft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen2.5-0.5b", help="model preset or local HF directory")
    p.add_argument("--rows", type=int, default=255, help="requests decoding in the full batch")
    p.add_argument("--batch-prompt-len", type=int, default=128, help="their prompts' tokens")
    p.add_argument("--prompt-len", type=int, default=2048, help="the arriving request's tokens")
    p.add_argument("--arrivals", type=int, default=8, help="requests timed, one at a time")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="model dtype on CUDA (fp32 on CPU)")  # fmt: skip
    p.add_argument("--device", default=None, help="device to run on (default: cuda if available)")
    p.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                   help="an EngineOptions field (repeatable; default: none, EngineOptions' "
                   "defaults)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the sampling")
    p.add_argument("--json", default=None,
                   help="also write the results to this file (default: print only)")  # fmt: skip


def bench_ttft(args, progress=None) -> dict:
    import torch

    from hybridflow.bench.common import (
        WARM_UP,
        engine_options,
        load_bench_model,
        make_prompts,
        sync_device,
    )
    from hybridflow.engine import Engine, RolloutService, SamplingParams
    from hybridflow.progress import quiet_reporter

    progress = progress or quiet_reporter()
    model, device = load_bench_model(args, progress)
    vocab = model.config.vocab_size
    batch = make_prompts(args.rows, args.batch_prompt_len, vocab, args.seed)
    arriving = make_prompts(args.arrivals + 1, args.prompt_len, vocab, args.seed + 1)
    max_seq_len = max(args.prompt_len + 1, 4 * args.batch_prompt_len)
    engine = Engine(model, max_batch_size=args.rows + 1, max_seq_len=max_seq_len,
                    options=engine_options(args))  # fmt: skip
    first = SamplingParams(temperature=1.0, ignore_eos=True, max_new_tokens=1, seed=args.seed)

    def prefill_alone(prompt) -> float:
        start = time.perf_counter()
        engine.generate([prompt], first)
        sync_device(device)
        return time.perf_counter() - start

    long = SamplingParams(temperature=1.0, ignore_eos=True, seed=args.seed,
                          max_new_tokens=max_seq_len - args.batch_prompt_len)  # fmt: skip
    with progress.task(WARM_UP):
        prefill_alone(arriving[0])  # compile, tune
        prefill_s = statistics.median(prefill_alone(p) for p in arriving[1:])
        engine.warm_up(long)
    ttfts, step_s = [], []
    arrivals = progress.task("arrivals into the full batch", total=args.arrivals, unit="requests")
    with arrivals as task, RolloutService(engine) as service:
        handles = [service.submit(p, long, stream=i == 0) for i, p in enumerate(batch)]
        next(iter(handles[0].stream(timeout=600)))  # the batch decodes
        service.submit(arriving[0], first).result(timeout=600)  # warm-up arrival
        for prompt in arriving[1:]:
            scheduler = engine.scheduler
            steps, start = scheduler.decode_steps, time.perf_counter()
            service.submit(prompt, first).result(timeout=600)
            ttfts.append(time.perf_counter() - start)
            time.sleep(0.05)  # decode a while: the next arrival meets a steady batch
            took = scheduler.decode_steps - steps
            step_s.append((time.perf_counter() - start) / max(took, 1))
            task.advance()
        for handle in handles:
            handle.abort()
    ttft, step = statistics.median(ttfts), statistics.median(step_s)
    engine.release()
    return {
        "preset": args.preset, "rows": args.rows, "prompt_len": args.prompt_len,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "engine_options": engine.options.to_dict(), "ttft_s": ttft, "ttfts_s": ttfts,
        "decode_step_s": step, "prefill_alone_s": prefill_s,
        "ttft_over_target": ttft / (prefill_s + 2 * step),
    }  # fmt: skip


def print_ttft(result: dict) -> None:
    print(f"{result['preset']} on {result['device']}: a {result['prompt_len']}-token request "
          f"into {result['rows']} decoding rows")  # fmt: skip
    print("| TTFT ms | decode step ms | its prefill alone ms | TTFT / (prefill + 2 steps) |")
    print("|---|---|---|---|")
    print(f"| {result['ttft_s'] * 1e3:.1f} | {result['decode_step_s'] * 1e3:.2f} | "
          f"{result['prefill_alone_s'] * 1e3:.1f} | {result['ttft_over_target']:.2f} |")  # fmt: skip


def run_ttft_command(args) -> int:
    from hybridflow.bench.common import run_bench_command

    return run_bench_command("ttft", args, bench_ttft, print_ttft)
