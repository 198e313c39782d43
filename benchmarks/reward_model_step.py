"""`python benchmarks/reward_model_step.py`: GRPO steps on one GPU scored by a reward model
against the same steps scored on the host (the rule reward's place): seconds per step, each
stage's time, and the peak GPU memory beside the memory plan's estimate.

    python benchmarks/reward_model_step.py                      # 1.5b policy, 1.5b reward model
    python benchmarks/reward_model_step.py --model qwen2.5-0.5b --reward-model qwen2.5-0.5b
    python benchmarks/reward_model_step.py --device cpu --model tiny --reward-model tiny \
        --prompts 2 --samples 2 --prompt-len 6 --new-tokens 5 --steps 2 --micro-tokens 256
        # CPU smoke run

Settings, one table row each, run one after the other in this process:

- rule: random scores on the controller (bench/grpo_steps.py's reward; a rule reward is host
  work of the same cost to the GPU: none);
- reward model: a ``*ForSequenceClassification`` checkpoint of the ``--reward-model`` preset's
  shape with random weights (written to a temporary directory first, bf16), beside the actor
  on the same GPU, scoring every sample (``reward.weights={model: 1}``) in packed forwards of
  ``--reward-tokens`` tokens;
- reward model, offloaded: the same with ``reward.model.param_offload=true`` (its weights in
  host memory except while it scores).

The step is the real loop's (bench/grpo_steps.py: fixed random prompts, forced full-length
responses, gradient checkpointing, one optimizer step per batch, bf16 compute, no reference).
s/step: the median of the steps after the first (the first compiles kernels and warms the
allocator); stages: their mean over those steps (``reward`` is the scoring). Peak:
torch.cuda.max_memory_allocated over all steps of the setting; plan: `hybridflow config
plan`'s peak for the same config and GPU, with its phase.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

SETTINGS = {
    "rule": (),
    "reward model": ("reward.model.param_offload=false",),
    "reward model, offloaded": ("reward.model.param_offload=true",),
}


def write_reward_model(preset: str, directory: Path) -> Path:
    """A random reward model of ``preset``'s shape, saved in bf16 (a transformers checkpoint)."""
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    model = build_model(preset_config(preset), dtype=torch.bfloat16, num_labels=1, seed=7)
    model.save_pretrained(str(directory))
    del model
    gc.collect()
    return directory


def setting_overrides(args, setting: str, reward_model: Path) -> tuple[str, ...]:
    rm = () if setting == "rule" else (
        f"reward.model.path={reward_model}", "reward.model.tokenizer_path=char",
        f"reward.model.max_tokens_per_gpu={args.reward_tokens}",
    )  # fmt: skip
    device = (f"trainer.device={args.device}",) if args.device else ()
    return ("model.tokenizer_path=char", *device, *rm, *SETTINGS[setting], *args.override)


def planned_peak(cfg, args) -> tuple[float, str]:
    """(GiB, phase) of the memory plan's peak for ``cfg`` on a GPU of --gpu-memory-gib, else
    on the visible GPU; nan without either."""
    from hybridflow.config import validate
    from hybridflow.trainer.plan.memory_from_config import plan_for_config

    if args.gpu_memory_gib is not None:
        gpu_bytes = int(args.gpu_memory_gib * 2**30)
    elif args.device != "cpu" and torch.cuda.is_available():
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        return float("nan"), "-"
    phase, peak = plan_for_config(cfg, validate(cfg), gpu_bytes).peak()
    return peak / 2**30, phase


def run_setting(args, setting: str, reward_model: Path) -> dict:
    from hybridflow.bench.grpo_steps import bench_config, time_grpo_steps
    from hybridflow.models import load_tokenizer
    from hybridflow.trainer.plan.memory_check import memory_defaults

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 60) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    overrides = setting_overrides(args, setting, reward_model)
    shape = dict(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                 new_tokens=args.new_tokens, micro_batch_tokens=args.micro_tokens)  # fmt: skip
    cfg = memory_defaults(
        bench_config(args.model, **shape, overrides=overrides), log=lambda _: None
    )
    plan_gib, plan_phase = planned_peak(cfg, args)
    weights = {"*": {"rule": 1.0}} if setting == "rule" else {"*": {"model": 1.0}}
    print(f"{setting}: running {args.steps} steps", file=sys.stderr, flush=True)
    times, peaks, stages = time_grpo_steps(
        model_path=args.model, prompts=prompts, samples_per_prompt=args.samples,
        new_tokens=args.new_tokens, steps=args.steps, micro_batch_tokens=args.micro_tokens,
        tokenizer=load_tokenizer("char"), overrides=overrides, reward_weights=weights,
    )  # fmt: skip
    gc.collect()
    if peaks:  # the one-GPU worker runs in this process: the next setting's peak is its own
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    timed = times[1:] or times
    return {
        "setting": setting,
        "step_s": statistics.median(timed),
        "all_steps_s": times,
        "stage_s": {
            k.removeprefix("timing_s/"): v for k, v in stages.items() if k != "timing_s/step"
        },
        "peak_gib": max(peaks, default=float("nan")),
        "plan_peak_gib": plan_gib,
        "plan_phase": plan_phase,
    }


def table_header(args) -> str:
    return "\n".join([
        f"policy {args.model}, reward model {args.reward_model}; {args.prompts} prompts x "
        f"{args.samples} samples of {args.prompt_len} + {args.new_tokens} tokens; s/step: "
        f"median of steps 2..{args.steps}",
        "| setting | s/step | vs rule | stages (s) | peak allocated GiB | plan peak GiB "
        "| plan / measured |",
        "|---|---|---|---|---|---|---|",
    ])  # fmt: skip


def table_row(row: dict, rule_step_s: float | None) -> str:
    stages = ", ".join(f"{k} {v:.2f}" for k, v in row["stage_s"].items())
    versus = f"{row['step_s'] / rule_step_s:.2f}x" if rule_step_s else "-"
    ratio = row["plan_peak_gib"] / row["peak_gib"]
    return (f"| {row['setting']} | {row['step_s']:.2f} | {versus} | {stages} "
            f"| {row['peak_gib']:.1f} | {row['plan_peak_gib']:.1f} ({row['plan_phase']}) "
            f"| {ratio:.2f} |")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="the policy's preset")
    parser.add_argument("--reward-model", default="qwen2.5-1.5b", help="the reward model's preset")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512, help="response tokens (no EOS)")
    parser.add_argument("--micro-tokens", type=int, default=16384, help="actor.max_tokens_per_gpu")
    parser.add_argument("--reward-tokens", type=int, default=16384,
                        help="reward.model.max_tokens_per_gpu")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (the first is warm-up)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--override", action="append", default=[], help="a config key=value")
    parser.add_argument("--device", default=None, help="trainer.device (cpu: a smoke run)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="plan for a GPU of this size (default: the visible one)")  # fmt: skip
    parser.add_argument("--json", default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="reward-model-") as scratch:
        reward_model = write_reward_model(args.reward_model, Path(scratch) / "rm")
        print(table_header(args), flush=True)
        rows, rule_step_s = [], None
        for setting in args.settings:  # each row as it ends
            rows.append(run_setting(args, setting, reward_model))
            if setting == "rule":
                rule_step_s = rows[-1]["step_s"]
            print(table_row(rows[-1], rule_step_s), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
