"""`python benchmarks/long_sequence_train.py`: GRPO steps on 16k-token sequences of a big preset
on one GPU, with gradient checkpointing and the log-prob token budget chosen by the memory plan;
the plan's peak beside the measured one, seconds per step and tokens/s.

    python benchmarks/long_sequence_train.py                # qwen2.5-7b, full-parameter, offload
    python benchmarks/long_sequence_train.py --lora 64      # LoRA adapters of rank 64 instead
    python benchmarks/long_sequence_train.py --preset tiny --device cpu --gpu-memory-gib 1 \\
        --prompt-len 32 --new-tokens 224 --micro-tokens 256 --steps 2          # smoke run

Default workload: --prompts 2 × --samples 4 sequences of a 1024-token prompt and 15,360 response
tokens (no EOS: rollout.ignore_eos), one optimizer step per batch, AdamW on the host
(actor.optimizer_offload=true) for the full-parameter run, off with --lora. The step is the real
loop's (bench/grpo_steps.py: fixed random prompts of the built-in character tokenizer's ids,
random rewards, random preset weights). ``model.gradient_checkpointing=auto`` and
``actor.log_prob_max_tokens_per_gpu`` are resolved as ``hybridflow train`` resolves them at run
start (trainer/memory_check.memory_choices) for the visible GPU, or for --gpu-memory-gib; the
update's budget ``actor.max_tokens_per_gpu`` is --micro-tokens (default: one whole sequence).
Peaks: torch.cuda.max_memory_allocated / max_memory_reserved over all steps (the one-GPU run is
in this process). s/step leaves out the first step (kernel compilation, allocator warm-up);
tokens/s counts prompt and response tokens. The old-log-prob pass runs
(actor.skip_old_logprob_on_policy=false), so the plan's forward budget batches it. Prints a markdown table; --json writes it.
"""

from __future__ import annotations

import argparse
import json
import random

import torch


def setting_overrides(args) -> tuple[str, ...]:
    """The config keys of the run before the memory plan's choices."""
    return (
        "model.tokenizer_path=char",
        "model.gradient_checkpointing=auto",
        f"model.lora_rank={args.lora}",
        # full-parameter: fp32 masters and AdamW state off the GPU; LoRA's are small
        f"actor.optimizer_offload={str(args.lora == 0).lower()}",
        # one optimizer step per batch would skip the old-log-prob pass (old = sg(current)):
        # run it, so the plan's forward budget is what batches it
        "actor.skip_old_logprob_on_policy=false",
        *([f"trainer.device={args.device}"] if args.device else []),
        *args.override,
    )


def gpu_bytes_for(args) -> int | None:
    """The GPU the plan chooses for: --gpu-memory-gib, else the visible one, else None."""
    if args.gpu_memory_gib is not None:
        return int(args.gpu_memory_gib * 2**30)
    if args.device != "cpu" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


def planned_run(args) -> dict:
    """The plan's choices (as overrides), its peak and the lines it logs, before anything loads."""
    from hybridflow.bench.grpo_steps import bench_config
    from hybridflow.config import validate
    from hybridflow.trainer.plan.memory_check import memory_choices
    from hybridflow.trainer.plan.memory_fixes import overrides_text
    from hybridflow.trainer.plan.memory_from_config import plan_for_config, with_changes

    cfg = bench_config(args.preset, prompts=args.prompts, samples=args.samples,
                       prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                       micro_batch_tokens=micro_tokens(args), overrides=setting_overrides(args))  # fmt: skip
    gpu_bytes = gpu_bytes_for(args)
    changes, lines = memory_choices(cfg, validate(cfg), gpu_bytes)
    chosen = with_changes(cfg, changes) if changes else cfg
    plan = plan_for_config(chosen, validate(chosen), gpu_bytes) if gpu_bytes else None
    phase, peak = plan.peak() if plan is not None else ("", 0)
    return {
        "choices": overrides_text(changes).split() if changes else [],
        "choice_lines": lines,
        "gradient_checkpointing": chosen.model.gradient_checkpointing,
        "update_tokens": chosen.actor.max_tokens_per_gpu,
        "log_prob_tokens": chosen.actor.log_prob_max_tokens_per_gpu,
        "plan_peak_gib": peak / 2**30 if plan is not None else None,
        "plan_phase": phase,
    }


def micro_tokens(args) -> int:
    return args.micro_tokens or args.prompt_len + args.new_tokens


def run_setting(args) -> dict:
    from hybridflow.bench.grpo_steps import time_grpo_steps
    from hybridflow.models import load_tokenizer
    from hybridflow.progress import ProgressReporter

    planned = planned_run(args)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 60) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    reporter = ProgressReporter(interval_s=20)  # a line per step, a status line in silences
    try:
        times, allocated, breakdown = time_grpo_steps(
            model_path=args.preset,
            prompts=prompts,
            samples_per_prompt=args.samples,
            new_tokens=args.new_tokens,
            steps=args.steps,
            micro_batch_tokens=micro_tokens(args),
            tokenizer=load_tokenizer("char"),
            progress=reporter,
            overrides=(*setting_overrides(args), *planned["choices"]),
        )
    finally:
        reporter.close()
    on_gpu = bool(allocated)  # the in-process worker ran on this process's GPU
    timed = times[1:] or times  # the first step compiles kernels and warms the allocator
    step_s = sum(timed) / len(timed)
    tokens = args.prompts * args.samples * (args.prompt_len + args.new_tokens)
    return {
        **planned,
        "setting": f"LoRA rank {args.lora}" if args.lora else "full, optimizer offload",
        "steps": len(times),
        "all_steps_s": times,
        "step_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "peak_allocated_gib": max(allocated) if on_gpu else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if on_gpu else None,
        "stage_s": {k.removeprefix("timing_s/"): v for k, v in breakdown.items()},
    }


def gib_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def stage_cell(row: dict, stage: str) -> str:
    """Mean seconds of a stage of the timed steps; "-" for a stage the step skipped."""
    return f"{row['stage_s'][stage]:.2f}" if stage in row["stage_s"] else "-"


def table(rows: list[dict], args) -> str:
    lines = [
        f"{args.preset}, {args.prompts} prompts x {args.samples} samples of {args.prompt_len} + "
        f"{args.new_tokens} tokens, mean of steps 2..{args.steps}",
        "| setting | checkpointing | update tokens | log-prob tokens | plan peak GiB "
        "| peak allocated GiB | peak reserved GiB | s/step | gen s | old log-prob s | update s "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plan = gib_cell(r["plan_peak_gib"]) + (f" ({r['plan_phase']})" if r["plan_phase"] else "")
        lines.append(
            f"| {r['setting']} | {'on' if r['gradient_checkpointing'] else 'off'} "
            f"| {r['update_tokens']:,} | {r['log_prob_tokens'] or r['update_tokens']:,} | {plan} "
            f"| {gib_cell(r['peak_allocated_gib'])} | {gib_cell(r['peak_reserved_gib'])} "
            f"| {r['step_s']:.2f} | {stage_cell(r, 'gen')} | {stage_cell(r, 'old_logprob')} "
            f"| {stage_cell(r, 'update_actor')} | {r['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen2.5-7b", help="a preset or a model directory")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=15360, help="response tokens (no EOS)")
    parser.add_argument("--micro-tokens", type=int, default=None,
                        help="actor.max_tokens_per_gpu (default: prompt + response)")  # fmt: skip
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA rank; 0: full")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (the first is warm-up)")
    parser.add_argument("--device", default=None, help="trainer.device (cpu: a smoke run)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="plan for a GPU of this size (default: the visible one)")  # fmt: skip
    parser.add_argument("--override", action="append", default=[], help="a config key=value")
    parser.add_argument("--json", default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rows = [run_setting(args)]
    for line in rows[0]["choice_lines"]:
        print(line)
    print(table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
