"""`python benchmarks/offload_step.py`: full-parameter GRPO steps with AdamW on the host
(actor.optimizer_offload=true): seconds per step, peak GPU memory, and the memory plan's
estimate beside them.

    python benchmarks/offload_step.py --model qwen2.5-7b --prompts 32 --samples 8 --new-tokens 512
    python benchmarks/offload_step.py --model qwen2.5-0.5b --compare   # and with AdamW on the GPU
    python benchmarks/offload_step.py --lora 64     # and LoRA adapters of rank 64 beside it
    python benchmarks/offload_step.py --model qwen2.5-32b --lora 64 --lora-only --prompts 16 \
        --micro-tokens 8192 --override model.dtype=bfloat16 \
        --override rollout.lora_in_place=true      # 32B LoRA on one H200, no rollout copy

The step is the real loop's (trainer/grpo_bench.py: fixed random prompts, random rewards,
gradient checkpointing, one optimizer step per batch, fp32 masters, bf16 compute). A preset has
random weights and no tokenizer: prompts are ids of the built-in character tokenizer. The
settings run one after the other in this process. Prints a markdown table; --json writes it.
"""

from __future__ import annotations

import argparse
import gc
import json
import random

import torch


def run_setting(args, offload: bool, lora_rank: int = 0) -> dict:
    from rich.console import Console

    from hybridflow.config import validate
    from hybridflow.models import load_tokenizer
    from hybridflow.progress import ProgressReporter
    from hybridflow.trainer.grpo_bench import bench_config, time_grpo_steps
    from hybridflow.trainer.memory_check import plan_for_config

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 60) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    overrides = (
        "model.tokenizer_path=char",
        f"actor.optimizer_offload={str(offload).lower()}",
        f"model.lora_rank={lora_rank}",
        *args.override,
    )
    shape = dict(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                 new_tokens=args.new_tokens, micro_batch_tokens=args.micro_tokens)  # fmt: skip
    cfg = bench_config(args.model, **shape, overrides=overrides)
    cuda = torch.cuda.is_available()
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else None
    plan = plan_for_config(cfg, validate(cfg), gpu_bytes)
    # a line per step and a status line in silences, on stderr: the table's rows print to
    # stdout as each setting ends, and stay one table
    reporter = ProgressReporter(Console(stderr=True), interval_s=20)
    try:
        times, peaks, _ = time_grpo_steps(
            model_path=args.model,
            prompts=prompts,
            samples_per_prompt=args.samples,
            new_tokens=args.new_tokens,
            steps=args.steps,
            micro_batch_tokens=args.micro_tokens,
            tokenizer=load_tokenizer("char"),
            progress=reporter,
            overrides=overrides,
        )
    finally:
        reporter.close()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    timed = times[1:] or times  # the first step compiles kernels and warms the allocator
    phase, planned = plan.peak()
    return {
        "setting": (f"LoRA r{lora_rank}, " if lora_rank else "full, ")
        + ("AdamW on the host" if offload else "AdamW on the GPU"),
        "steps": len(times),
        "step_s": sum(timed) / len(timed),
        "all_steps_s": times,
        "peak_gib": max(peaks, default=float("nan")),
        "plan_peak_gib": planned / 2**30,
        "plan_phase": phase,
        "plan_host_gib": plan.host_bytes() / 2**30,
    }


def table_header(args) -> str:
    return "\n".join([
        f"{args.model}, {args.prompts} prompts x {args.samples} samples of {args.prompt_len} + "
        f"{args.new_tokens} tokens, {args.micro_tokens:,}-token micro-batches",
        "| setting | steps | s/step | peak GPU GiB | plan peak GiB | plan host GiB |",
        "|---|---|---|---|---|---|",
    ])  # fmt: skip


def table_row(r: dict) -> str:
    return (f"| {r['setting']} | {r['steps']} | {r['step_s']:.2f} | {r['peak_gib']:.1f} "
            f"| {r['plan_peak_gib']:.1f} ({r['plan_phase']}) | {r['plan_host_gib']:.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-7b", help="a preset or a model directory")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512, help="response tokens (no EOS)")
    parser.add_argument("--micro-tokens", type=int, default=16384, help="actor.max_tokens_per_gpu")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (the first is warm-up)")
    parser.add_argument("--compare", action="store_true", help="also run with AdamW on the GPU")
    parser.add_argument("--override", action="append", default=[], help="a config key=value")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="also run LoRA adapters of this rank (AdamW on the GPU)")  # fmt: skip
    parser.add_argument("--lora-only", action="store_true",
                        help="only the LoRA run (a model whose full training cannot fit)")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.lora_only and not args.lora:
        parser.error("--lora-only needs --lora RANK")
    settings = [] if args.lora_only else [dict(offload=True)]
    if args.compare and not args.lora_only:
        settings.append(dict(offload=False))
    if args.lora:
        settings.append(dict(offload=False, lora_rank=args.lora))
    print(table_header(args), flush=True)
    rows = []
    for setting in settings:  # each row as it ends: a later setting that dies leaves the rest
        rows.append(run_setting(args, **setting))
        print(table_row(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
