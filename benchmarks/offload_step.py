"""`python benchmarks/offload_step.py`: GRPO steps of a big model on one GPU, full-parameter
with AdamW on the host (actor.optimizer_offload=true) and LoRA: the memory plan's verdict, and
for each setting that fits, seconds per step, each stage's time, tokens/s/GPU and the peak GPU
memory beside the plan's estimate.

    python benchmarks/offload_step.py --model qwen2.5-7b --prompts 32 --samples 8 --new-tokens 512
    python benchmarks/offload_step.py --model qwen2.5-0.5b --compare   # and with AdamW on the GPU
    python benchmarks/offload_step.py --lora 64     # and LoRA adapters of rank 64 beside it
    python benchmarks/offload_step.py --model qwen2.5-32b --lora 64 --lora-only --prompts 16 \
        --micro-tokens 8192 --override model.dtype=bfloat16 \
        --override rollout.lora_in_place=true      # 32B LoRA on one H200, no rollout copy
    python benchmarks/offload_step.py --model qwen3-30b-a3b --prompts 32 --samples 8 \
        --prompt-len 512 --new-tokens 512 --micro-tokens 8192 --lora 64 --lora-offload \
        --lora-override model.dtype=bfloat16 --override actor.router_replay=rollout
        # Qwen3-30B-A3B: full-parameter (the plan's verdict on the host's memory), then LoRA
        # rank 64 on attention and every expert, AdamW on the host, routing replay

The step is the real loop's (bench/grpo_steps.py: fixed random prompts, random rewards,
gradient checkpointing, one optimizer step per batch, bf16 compute). A preset has random
weights and no tokenizer: prompts are ids of the built-in character tokenizer. The settings
run one after the other in this process. Before each, the memory plan (`hybridflow config
plan`'s) is checked against the GPU and against the host's free memory, as `hybridflow train`
checks them; a setting that does not fit is not run, and its reason is printed.

s/step: the median of the steps after the first (the first compiles kernels and warms the
allocator); stages: their mean over those steps. tokens/s/GPU: prompt + response tokens of a
step over its time, per GPU (NeMo-RL's definition). Peaks: torch.cuda.max_memory_allocated and
max_memory_reserved over all steps; plan / measured: the plan's peak over the allocated one.
Prints a markdown table, a row as each setting ends; --json writes the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys

import torch


def setting_name(offload: bool, lora_rank: int) -> str:
    return (f"LoRA r{lora_rank}, " if lora_rank else "full, ") + (
        "AdamW on the host" if offload else "AdamW on the GPU"
    )


def setting_overrides(args, offload: bool, lora_rank: int) -> tuple[str, ...]:
    """The config keys of one setting: --override, then --lora-override for a LoRA one."""
    return (
        "model.tokenizer_path=char",
        f"actor.optimizer_offload={str(offload).lower()}",
        f"model.lora_rank={lora_rank}",
        *([f"trainer.device={args.device}"] if args.device else []),
        *args.override,
        *(args.lora_override if lora_rank else ()),
    )


def gpu_bytes_for(args) -> tuple[int | None, str]:
    """(the GPU the plan is checked against, where its size comes from): --gpu-memory-gib,
    else the visible GPU, else (None, "") (the plan is printed, not checked)."""
    if args.gpu_memory_gib is not None:
        return int(args.gpu_memory_gib * 2**30), "--gpu-memory-gib"
    if args.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "the visible GPU"
    return None, ""


def host_bytes_for(args) -> tuple[int | None, str]:
    """(the host memory the plan is checked against, where the number comes from)."""
    from hybridflow.trainer.plan.host_memory import available_host_bytes

    if args.host_memory_gib is not None:
        return int(args.host_memory_gib * 2**30), "--host-memory-gib"
    return available_host_bytes()


def plan_verdict(cfg, gpu: tuple[int | None, str], host: tuple[int | None, str]) -> dict:
    """The memory plan of ``cfg`` and whether it fits the GPU and the host, as `hybridflow
    train` checks them before anything loads: {plan, plan_peak_gib, plan_phase,
    plan_host_gib, problems} (problems: [] when it fits)."""
    from hybridflow.config import validate
    from hybridflow.trainer.plan.host_memory import host_need_for, host_problems
    from hybridflow.trainer.plan.memory_fixes import fit_problems
    from hybridflow.trainer.plan.memory_from_config import plan_for_config

    derived = validate(cfg)
    plan = plan_for_config(cfg, derived, gpu[0])
    phase, planned = plan.peak()
    need = host_need_for(cfg, derived, plan if gpu[0] is not None else None)
    problems = fit_problems(cfg, plan, gpu[1]) + host_problems(need, cfg, *host)
    return {
        "plan": plan,
        "plan_peak_gib": planned / 2**30,
        "plan_phase": phase,
        "plan_host_gib": plan.host_bytes() / 2**30,
        "host_need_gib": need.total / 2**30,
        "problems": problems,
    }


def run_setting(args, offload: bool, lora_rank: int = 0) -> dict:
    from rich.console import Console

    from hybridflow.bench.grpo_steps import bench_config, time_grpo_steps
    from hybridflow.models import load_tokenizer
    from hybridflow.progress import ProgressReporter

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 60) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    overrides = setting_overrides(args, offload, lora_rank)
    shape = dict(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                 new_tokens=args.new_tokens, micro_batch_tokens=args.micro_tokens)  # fmt: skip
    verdict = plan_verdict(bench_config(args.model, **shape, overrides=overrides),
                           gpu_bytes_for(args), host_bytes_for(args))  # fmt: skip
    row = {"setting": setting_name(offload, lora_rank), "fits": not verdict["problems"],
           **{k: v for k, v in verdict.items() if k != "plan"}}  # fmt: skip
    print(f"{row['setting']}: plan peak {row['plan_peak_gib']:.1f} GiB ({row['plan_phase']}), "
          f"host {row['host_need_gib']:.1f} GiB: " + ("fits" if row["fits"] else
          "does NOT fit, not run: " + " ".join(row["problems"])),
          file=sys.stderr, flush=True)  # on stdout the table stays one block  # fmt: skip
    if not row["fits"] or args.plan_only:
        return row
    # a line per step and a status line in silences, on stderr: the table's rows print to
    # stdout as each setting ends, and stay one table
    reporter = ProgressReporter(Console(stderr=True), interval_s=20)
    try:
        times, peaks, stages = time_grpo_steps(
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
    cuda = bool(peaks)  # the one-GPU worker runs in this process
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the next setting's peaks are its own
    tokens = args.prompts * args.samples * (args.prompt_len + args.new_tokens)
    peak = max(peaks, default=float("nan"))
    return {**row, **step_numbers(times, stages, tokens), "peak_gib": peak,
            "peak_reserved_gib": reserved}  # fmt: skip


def step_numbers(times: list[float], stages: dict[str, float], tokens: int, gpus: int = 1) -> dict:
    """s/step (median of the steps after the first, which compiles and warms up), the mean
    stage times of those steps, and prompt + response tokens per second per GPU."""
    timed = times[1:] or times
    step_s = statistics.median(timed)
    return {
        "steps": len(times),
        "step_s": step_s,
        "all_steps_s": times,
        "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": tokens / step_s / gpus,
        "stage_s": {
            k.removeprefix("timing_s/"): v for k, v in stages.items() if k != "timing_s/step"
        },
    }


def table_header(args) -> str:
    return "\n".join([
        f"{args.model}, {args.prompts} prompts x {args.samples} samples of {args.prompt_len} + "
        f"{args.new_tokens} tokens, {args.micro_tokens:,}-token micro-batches, s/step: median "
        f"of steps 2..{args.steps}",
        "| setting | plan | s/step | tokens/s/GPU | stages (s) | peak allocated GiB "
        "| peak reserved GiB | plan peak GiB | plan / measured | plan host GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ])  # fmt: skip


def table_row(r: dict) -> str:
    plan = f"{r['plan_peak_gib']:.1f} ({r['plan_phase']})"
    if not r["fits"] or "step_s" not in r:  # --plan-only: planned, not run
        verdict = "fits" if r["fits"] else "does not fit"
        return (f"| {r['setting']} | {verdict} | - | - | - | - | - | {plan} | - "
                f"| {r['plan_host_gib']:.1f} |")  # fmt: skip
    stages = ", ".join(f"{k} {v:.2f}" for k, v in r["stage_s"].items())
    ratio = r["plan_peak_gib"] / r["peak_gib"] if r["peak_gib"] == r["peak_gib"] else float("nan")
    return (f"| {r['setting']} | fits | {r['step_s']:.2f} | {r['tokens_per_s_per_gpu']:,.0f} "
            f"| {stages} | {r['peak_gib']:.1f} | {r['peak_reserved_gib']:.1f} | {plan} "
            f"| {ratio:.2f} | {r['plan_host_gib']:.1f} |")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
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
                        help="also run LoRA adapters of this rank")  # fmt: skip
    parser.add_argument("--lora-only", action="store_true",
                        help="only the LoRA run (a model whose full training cannot fit)")  # fmt: skip
    parser.add_argument("--lora-offload", action="store_true",
                        help="the LoRA run with AdamW on the host (default: on the GPU)")  # fmt: skip
    parser.add_argument("--lora-override", action="append", default=[],
                        help="a config key=value of the LoRA run only (model.dtype=bfloat16)")  # fmt: skip
    parser.add_argument("--device", default=None, help="trainer.device (cpu: a smoke run)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="check the plan against a GPU of this size (default: the visible one)")  # fmt: skip
    parser.add_argument("--host-memory-gib", type=float, default=None,
                        help="check the plan against this much free host memory (default: "
                        "MemAvailable and the cgroup's limit)")  # fmt: skip
    parser.add_argument("--plan-only", action="store_true",
                        help="print each setting's plan and verdict, run nothing")  # fmt: skip
    parser.add_argument("--json", default=None)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.lora_only and not args.lora:
        parser.error("--lora-only needs --lora RANK")
    settings = [] if args.lora_only else [dict(offload=True)]
    if args.compare and not args.lora_only:
        settings.append(dict(offload=False))
    if args.lora:
        settings.append(dict(offload=args.lora_offload, lora_rank=args.lora))
    print(table_header(args), flush=True)
    rows = []
    for setting in settings:  # each row as it ends: a later setting that dies leaves the rest
        rows.append(run_setting(args, **setting))
        print(table_row(rows[-1]), flush=True)
    for row in rows:
        if not row["fits"]:
            print(f"\n{row['setting']}, the plan's verdict: " + " ".join(row["problems"]),
                  flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
