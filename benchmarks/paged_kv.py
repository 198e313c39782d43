"""`python benchmarks/paged_kv.py`: the paged KV cache against the slot cache at one memory
budget, on long responses whose lengths have a long tail.

    python benchmarks/paged_kv.py --preset qwen2.5-7b --prompts 64 --samples 8 \\
        --prompt-len 1024 --mean-new-tokens 3072 --max-new-tokens 16384 --kv-gib 40
    python benchmarks/paged_kv.py --preset tiny --device cpu --prompts 4 --samples 2 \\
        --prompt-len 16 --mean-new-tokens 24 --max-new-tokens 64 --kv-gib 0.001   # smoke run

Each request's max_new_tokens is drawn from a log-normal of the given mean (sigma 1: a few
requests run 5-10x the mean), cut at --max-new-tokens, and responses run to their budget
(no EOS), so both caches generate exactly the same tokens. The slot cache reserves
prompt + max-new-tokens positions for every sequence, so the budget holds few of them; the
paged cache hands out --block-size blocks as sequences grow and shares each prompt's blocks
among its samples. One engine each, same weights, same budget, one after the other in this
process; each engine first captures every batch bucket's graph with its kernel choices
(Engine.warm_up, untimed; --cache-dir keeps the choices for the next run). Printed while it
runs: a progress line every --progress-s seconds; then tokens/s, wall time, the mean rows
decoded per step, the sequences the cache could hold at full length, the preemptions and
the tokens prefilled (prompts once per prompt, and again for each preempted request).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import threading
import time

import torch


def request_budgets(count: int, mean: float, most: int, seed: int) -> list[int]:
    """Per-request max_new_tokens: log-normal (sigma 1) of mean `mean`, within [1, most]."""
    rng = random.Random(seed)
    mu = math.log(mean) - 0.5  # the mean of a log-normal is exp(mu + sigma^2 / 2)
    return [max(1, min(most, round(rng.lognormvariate(mu, 1.0)))) for _ in range(count)]


def run_cache(model, args, block_size, prompts, budgets) -> dict:
    from hybridflow.engine import Engine, EngineOptions, SamplingParams

    options = EngineOptions(kv_block_size=block_size, cache_dir=args.cache_dir)
    max_seq_len = args.prompt_len + args.max_new_tokens
    engine = Engine(model, max_batch_size=len(budgets), max_seq_len=max_seq_len,
                    memory_budget=int(args.kv_gib * 2**30), options=options)  # fmt: skip
    params = SamplingParams(n=args.samples, temperature=1.0, ignore_eos=True, seed=0,
                            max_new_tokens=args.max_new_tokens)  # fmt: skip
    name = "slot" if block_size is None else f"paged ({block_size})"
    print(f"{name}: {engine.num_slots} slots; warming up every batch bucket", flush=True)
    start = time.perf_counter()
    graphs = engine.warm_up(params)  # every batch bucket's graph and kernel choices, untimed
    print(f"{name}: warm-up {time.perf_counter() - start:.1f} s ({graphs} graphs)", flush=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    done = threading.Event()
    reporter = threading.Thread(target=_report, args=(engine, name, done, args.progress_s),
                                daemon=True)  # fmt: skip
    start = time.perf_counter()
    reporter.start()
    try:
        out = engine.generate(prompts, params, max_new_tokens=budgets)
        sync()
    finally:
        done.set()
    seconds = time.perf_counter() - start
    scheduler = engine.scheduler
    tokens = sum(len(c.token_ids) for c in out)
    paging = scheduler.paging
    full_length = (engine.cache.num_slots if paging is None
                   else engine.cache.num_blocks * engine.cache.block_size // max_seq_len)  # fmt: skip
    result = dict(
        cache=name, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
        mean_rows=scheduler.decoded_rows / max(1, scheduler.decode_steps),
        full_length_sequences=full_length,
        preemptions=paging.preemptions if paging is not None else 0,
        prefill_tokens=engine.prefill_tokens,
        token_ids=[c.token_ids for c in out],
    )  # fmt: skip
    engine.release()
    return result


def _report(engine, name: str, done: threading.Event, every_s: float) -> None:
    """Every `every_s` seconds while a generate() runs: the rows decoding, the tokens decoded
    so far and their rate (a run cut short by a time limit still says where it was)."""
    start = time.perf_counter()
    while not done.wait(every_s):
        scheduler = engine.scheduler
        if scheduler is None:
            continue
        paging = scheduler.paging
        elapsed = time.perf_counter() - start
        print(f"  {name} at {elapsed:.0f} s: {len(scheduler.rows)} rows, "
              f"{scheduler.decoded_rows:,} tokens decoded ({scheduler.decoded_rows / elapsed:,.0f}"
              f"/s), {scheduler.decode_steps} steps, preemptions "
              f"{paging.preemptions if paging is not None else 0}, prefilled "
              f"{engine.prefill_tokens:,}", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--mean-new-tokens", type=float, default=3072)
    p.add_argument("--max-new-tokens", type=int, default=16384)
    p.add_argument("--kv-gib", type=float, default=40.0, help="the KV budget of both caches")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--caches", nargs="+", default=["paged", "slot"])
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--cache-dir", default=None, help="the engine's pinned choices")
    p.add_argument("--progress-s", type=float, default=20.0, help="seconds between progress lines")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from hybridflow.models import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(args.preset, dtype=dtype, device=device).eval().requires_grad_(False)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]  # fmt: skip
    budgets = request_budgets(args.prompts * args.samples, args.mean_new_tokens,
                              args.max_new_tokens, seed=2)  # fmt: skip
    print(f"{args.preset} on {device}: {args.prompts} prompts x {args.samples}, prompt "
          f"{args.prompt_len}, max_new_tokens mean {sum(budgets) / len(budgets):.0f} max "
          f"{max(budgets)}, KV budget {args.kv_gib} GiB", flush=True)  # fmt: skip
    results = []
    for cache in args.caches:
        block = None if cache == "slot" else args.block_size
        results.append(run_cache(model, args, block, prompts, budgets))
        r = results[-1]
        print(f"{r['cache']}: {r['tokens_per_s']:,.0f} tok/s, {r['seconds']:.1f} s, mean rows "
              f"{r['mean_rows']:.1f}, preemptions {r['preemptions']}, prefilled "
              f"{r['prefill_tokens']:,} tokens", flush=True)  # fmt: skip
    same = all(r["token_ids"] == results[0]["token_ids"] for r in results)
    print("\n| cache | tok/s | s | mean rows / step | sequences at full length | preemptions |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['cache']} | {r['tokens_per_s']:,.0f} | {r['seconds']:.1f} | "
            f"{r['mean_rows']:.1f} | {r['full_length_sequences']} | {r['preemptions']} |"
        )
    if len(results) > 1:
        print(f"speed-up of {results[0]['cache']} over {results[-1]['cache']}: "
              f"{results[0]['tokens_per_s'] / results[-1]['tokens_per_s']:.2f}x; "
              f"identical tokens: {same}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "token_ids"} for r in results], f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
