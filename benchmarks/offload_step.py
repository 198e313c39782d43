"""`python benchmarks/offload_step.py`: full-parameter GRPO steps with AdamW on the host
(actor.optimizer_offload=true): seconds per step, peak GPU memory, and the memory plan's
estimate beside them.

    python benchmarks/offload_step.py --model qwen2.5-7b --prompts 32 --samples 8 --new-tokens 512
    python benchmarks/offload_step.py --model qwen2.5-0.5b --compare   # and with AdamW on the GPU

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


def run_setting(args, offload: bool) -> dict:
    from hybridflow.config import validate
    from hybridflow.models import load_tokenizer
    from hybridflow.trainer.grpo_bench import bench_config, time_grpo_steps
    from hybridflow.trainer.memory_check import plan_for_config

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 60) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    overrides = (
        "model.tokenizer_path=char",
        f"actor.optimizer_offload={str(offload).lower()}",
        *args.override,
    )
    shape = dict(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                 new_tokens=args.new_tokens, micro_batch_tokens=args.micro_tokens)  # fmt: skip
    cfg = bench_config(args.model, **shape, overrides=overrides)
    cuda = torch.cuda.is_available()
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else None
    plan = plan_for_config(cfg, validate(cfg), gpu_bytes)
    times, peaks, _ = time_grpo_steps(
        model_path=args.model,
        prompts=prompts,
        samples_per_prompt=args.samples,
        new_tokens=args.new_tokens,
        steps=args.steps,
        micro_batch_tokens=args.micro_tokens,
        tokenizer=load_tokenizer("char"),
        overrides=overrides,
    )
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    timed = times[1:] or times  # the first step compiles kernels and warms the allocator
    phase, planned = plan.peak()
    return {
        "optimizer": "host (offload)" if offload else "GPU",
        "steps": len(times),
        "step_s": sum(timed) / len(timed),
        "all_steps_s": times,
        "peak_gib": max(peaks, default=float("nan")),
        "plan_peak_gib": planned / 2**30,
        "plan_phase": phase,
        "plan_host_gib": plan.host_bytes() / 2**30,
    }


def table(rows: list[dict], args) -> str:
    lines = [
        f"{args.model}, {args.prompts} prompts x {args.samples} samples of {args.prompt_len} + "
        f"{args.new_tokens} tokens, full-parameter, {args.micro_tokens:,}-token micro-batches",
        "| optimizer | steps | s/step | peak GPU GiB | plan peak GiB | plan host GiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['optimizer']} | {r['steps']} | {r['step_s']:.2f} | {r['peak_gib']:.1f} "
                     f"| {r['plan_peak_gib']:.1f} ({r['plan_phase']}) | {r['plan_host_gib']:.1f} |")  # fmt: skip
    return "\n".join(lines)


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
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [run_setting(args, offload=True)]
    if args.compare:
        rows.append(run_setting(args, offload=False))
    print(table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
