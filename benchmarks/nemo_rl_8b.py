"""`python benchmarks/nemo_rl_8b.py`: NeMo-RL's Llama-3.1-8B-Instruct GRPO recipe
(grpo-llama3.1-8b-instruct-2n8g) on one GPU: tokens/s/GPU by NeMo-RL's definition, s/step
and each stage's share, beside NeMo-RL's published figures.

    python benchmarks/nemo_rl_8b.py --warmup-steps 1       # one H200: 8 prompts x 32, a warm step
    python benchmarks/nemo_rl_8b.py                        # the same step, compilation included
    python benchmarks/nemo_rl_8b.py --warmup-steps 1 --sequence-len 1024 --prompts 8 12
                                                           # tokens/s/GPU against prompt count
    python benchmarks/nemo_rl_8b.py --model tiny --prompts 1 2 --samples 4 --prompt-len 8 \
        --sequence-len 24 --device cpu                     # the logic, on the CPU

What each mode shows. --warmup-steps 1 (8.3 min on one H200 at 4,096 tokens with Triton's,
Inductor's and the engine's caches filled by a shorter run first; over 10 with none): the recipe's
step warm, the number to compare with NeMo-RL's: a warm-up run of --warmup-sequence-len
(512) tokens per sequence first compiles the training layers (torch.compile, dynamic shapes:
packed micro-batches of any length reuse the graphs), JITs the Triton kernels and pins the
engine's timing choices (trainer.cache_dir/engine-choices: read by the next engine), with the
timed run's memory choices (checkpointing, token budgets) so the graphs are the same; then a
fresh actor and engine time the full-length step (their build is not in s/step). Two full
steps (--steps 2) do not fit a 10-minute limit. What the timed run still compiled is printed
(torch.compile graphs, new engine timing choices): the decode layer is timed once per
batch-size bucket, and buckets the warm-up never decoded (the smaller batches a KV cache that
cannot hold every row decodes after preempting) are timed in the timed step. CUDA graphs are
captured at every generation either way (the cache is freed after each, and the graphs
with it). Without --warmup-steps: one step, compilation included (a first step's cost).
Several --prompts at a shorter --sequence-len (1024, ~3 min a prompt count with its warm-up):
tokens/s/GPU against the prompt count, each warm, each a fresh actor and engine; flat: the
step's time grows in proportion to its tokens.

The recipe: Llama-3.1-8B-Instruct, GRPO, 64 prompts x 32 generations a step, sequences
(prompt + response) up to 4,096 tokens, 512 sequences per optimizer step (AdamW, lr 3e-7,
weight decay 0.01), a k3 KL penalty of 0.01 to the reference policy, bf16; published on 16
H100s: 1,581 tokens/s/GPU on-policy (92.8 s/step), 2,478 one step off policy
(docs.nvidia.com/nemo/rl/latest/about/performance-summary.html).

Here: the llama3.1-8b preset with random weights, so every response runs to its maximum
(the sequence length); 256-token random prompts; the prompt count scaled down to what one run
can time (8 x 32 = 256 sequences a step by default); full-parameter, AdamW on the GPU when
the memory plan says it fits, else on the host (actor.optimizer_offload, the plan's
requirement on one H200); gradient checkpointing and token budgets as the plan decides; the
KV cache takes 90% of the memory free during generation (rollout.gpu_memory_utilization=auto:
the cache is freed after it, nothing else runs then; the table's KV rows: how many
full-length sequences that holds at once, 177 of 256 on one H200 (141 GiB), 74 at 0.4, by the plan); the
real loop's step (bench/grpo_steps.py: random rewards, no EOS). The old-log-prob pass is
skipped when a step is one optimizer step (actor.skip_old_logprob_on_policy), as hybridflow
runs it; NeMo-RL computes it.

tokens/s/GPU = (prompt + response tokens of every sequence of a step) / (step seconds x GPUs),
NeMo-RL's definition. s/step: the median of the steps after the first (the first compiles);
with --steps 1, that one step: warm after --warmup-steps, else compilation included.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload_step import gpu_bytes_for, host_bytes_for, plan_verdict, step_numbers  # noqa: E402

PUBLISHED = {"on-policy": (1581, 92.8), "one step off": (2478, None)}
"""NeMo-RL's tokens/s/GPU (and s/step) of the recipe on 16 H100s (Megatron backend)."""
RECIPE_SEQUENCES_PER_OPTIMIZER_STEP = 512


def recipe_overrides(args, prompts: int, offload: bool) -> tuple[str, ...]:
    """The recipe's settings as hybridflow config keys, then --override."""
    per_optimizer_step = max(1, RECIPE_SEQUENCES_PER_OPTIMIZER_STEP // args.samples)
    return (
        "model.tokenizer_path=char",
        f"actor.optimizer_offload={str(offload).lower()}",
        f"actor.ppo_mini_batch_size={min(prompts, per_optimizer_step)}",
        "actor.lr=3e-7",
        "actor.weight_decay=0.01",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.01",
        "actor.kl_loss_type=low_var_kl",  # k3
        "model.gradient_checkpointing=auto",
        *([f"trainer.device={args.device}"] if args.device else []),
        *args.override,
    )


def choose_optimizer(args, prompts: int) -> tuple[bool | None, list[str]]:
    """(AdamW on the host?, the plan's problems): on the GPU if the plan fits it, else on the
    host if that fits; (None, problems) if neither does."""
    problems: list[str] = []
    for offload in (False, True):
        cfg = recipe_config(args, prompts, offload)
        verdict = plan_verdict(cfg, gpu_bytes_for(args), host_bytes_for(args))
        if not verdict["problems"]:
            return offload, []
        problems = verdict["problems"]
    return None, problems


def new_tokens(args) -> int:
    return args.sequence_len - args.prompt_len


def at_sequence_len(args, sequence_len: int) -> argparse.Namespace:
    """args with another --sequence-len (the warm-up's)."""
    return argparse.Namespace(**{**vars(args), "sequence_len": sequence_len})


def recipe_config(args, prompts: int, offload: bool):
    """The recipe's config before the memory plan's choices."""
    from hybridflow.bench.grpo_steps import bench_config

    return bench_config(args.model, prompts=prompts, samples=args.samples,
                        prompt_len=args.prompt_len, new_tokens=new_tokens(args),
                        micro_batch_tokens=args.micro_tokens,
                        overrides=recipe_overrides(args, prompts, offload))  # fmt: skip


def kv_sequences(args, prompts: int, offload: bool) -> int | None:
    """Full-length sequences the memory plan's KV cache holds at once (the engine sizes it
    from the memory free when generation starts, as the plan does); None: GPU size unknown."""
    from hybridflow.config import validate
    from hybridflow.trainer.plan.memory_from_config import plan_for_config

    gpu_bytes, _ = gpu_bytes_for(args)
    if gpu_bytes is None:
        return None
    cfg = recipe_config(args, prompts, offload)
    plan = plan_for_config(cfg, validate(cfg), gpu_bytes)
    return plan.kv_slots if plan is not None else None


def stage_floors_s(args, prompts: int, offload: bool) -> dict[str, float]:
    """{stage: floor seconds} at the GPU's peaks (hybridflow/trainer/plan/stage_floors.py), with
    the recomputation the memory plan chooses and the decode steps its KV cache allows;
    {} on a CPU or an unknown GPU."""
    from hybridflow.trainer.observe.metrics import peak_flops_per_gpu
    from hybridflow.trainer.plan.architecture import model_architecture
    from hybridflow.trainer.plan.memory_check import memory_defaults
    from hybridflow.trainer.plan.stage_floors import StepShape, peak_bandwidth, stage_floors

    name = device_name(args)
    architecture = model_architecture(args.model)
    if name == "cpu" or architecture is None:
        return {}
    cfg = recipe_config(args, prompts, offload)
    # "auto" left unresolved (no GPU to plan for) means off, as a run resolves it there
    recompute = memory_defaults(cfg, log=lambda line: None).model.gradient_checkpointing is True
    shape = StepShape(prompts, args.samples, args.prompt_len, new_tokens(args))
    sequences = kv_sequences(args, prompts, offload)
    floors = stage_floors(architecture, shape, peak_flops_per_gpu(name), peak_bandwidth(name),
                          recompute=recompute,
                          kv_tokens=sequences * args.sequence_len if sequences else None)  # fmt: skip
    return {k.removeprefix("timing_s/"): v for k, v in floors.items()}


def memory_choice_overrides(args, prompts: int, offload: bool) -> tuple[str, ...]:
    """The memory plan's choices for the timed run (checkpointing, token budgets) as
    key=value: a warm-up at another length runs with them, so it compiles the same graphs."""
    from hybridflow.config import validate
    from hybridflow.trainer.plan.memory_check import memory_choices
    from hybridflow.trainer.plan.memory_fixes import overrides_text

    cfg = recipe_config(args, prompts, offload)
    changes, _ = memory_choices(cfg, validate(cfg), gpu_bytes_for(args)[0])
    return tuple(overrides_text(changes).split())


def compile_activity(args) -> dict[str, int]:
    """What this process has compiled so far: torch.compile's graphs and the rollout engine's
    pinned timing choices (kernels and decode layers per batch-size bucket, under
    trainer.cache_dir); the difference over the timed steps shows what they compiled."""
    graphs = 0
    if "torch._dynamo" in sys.modules:  # never imported: nothing compiled
        from torch._dynamo.utils import counters

        graphs = int(counters["stats"]["unique_graphs"])
    cfg = recipe_config(args, args.prompts[0], True)
    folder = os.path.join(os.path.expanduser(cfg.trainer.cache_dir), "engine-choices")
    files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    choices = 0
    for name in files:  # engine/choices.py's files: {"identity": ..., "choices": {...}}
        try:
            with open(os.path.join(folder, name)) as f:
                choices += len(json.load(f).get("choices", {}))
        except (OSError, ValueError):
            continue  # half-written by another process: its choices are made again
    return {"compiled_graphs": graphs, "engine_choices": choices}


def grpo_steps(args, prompts: int, offload: bool, steps: int, overrides: tuple[str, ...] = ()):
    """(seconds per step, peak GiB, mean stage seconds) of `steps` GRPO steps of a fresh
    actor and engine at args' shape."""
    from rich.console import Console

    from hybridflow.bench.grpo_steps import time_grpo_steps
    from hybridflow.models import load_tokenizer
    from hybridflow.progress import ProgressReporter

    rng = random.Random(prompts)
    ids = [[rng.randrange(10, 60) for _ in range(args.prompt_len)] for _ in range(prompts)]
    # a line per step and a status line in silences, on stderr (a step takes minutes)
    reporter = ProgressReporter(Console(stderr=True), interval_s=30)
    try:
        return time_grpo_steps(
            model_path=args.model,
            prompts=ids,
            samples_per_prompt=args.samples,
            new_tokens=new_tokens(args),
            steps=steps,
            micro_batch_tokens=args.micro_tokens,
            tokenizer=load_tokenizer("char"),
            progress=reporter,
            overrides=recipe_overrides(args, prompts, offload) + overrides,
        )
    finally:
        reporter.close()
        # the next run builds its own actor: this one's GPU memory and pinned host state
        # (the host optimizer's ~94 GiB for the 8B) must be gone first, cycles included
        gc.collect()
        if torch.cuda.is_available() and args.device != "cpu":
            torch.cuda.empty_cache()


def run_prompts(args, prompts: int) -> dict:
    """One prompt count: the plan's optimizer placement, the warm-up run if asked (same
    process, the timed run's memory choices), then the timed steps."""
    offload, problems = choose_optimizer(args, prompts)
    row = {"prompts": prompts, "sequences": prompts * args.samples}
    if offload is None:
        return {**row, "problems": problems}
    if args.warmup_steps:
        warm = at_sequence_len(args, args.warmup_sequence_len)
        grpo_steps(warm, prompts, offload, args.warmup_steps,
                   memory_choice_overrides(args, prompts, offload))  # fmt: skip
    before = compile_activity(args)
    times, peaks, stages = grpo_steps(args, prompts, offload, args.steps)
    after = compile_activity(args)
    tokens = prompts * args.samples * args.sequence_len
    return {**row, "optimizer": "host" if offload else "device",
            "peak_gib": max(peaks, default=float("nan")),
            "kv_sequences": kv_sequences(args, prompts, offload),
            "floor_s": stage_floors_s(args, prompts, offload),
            "compiled_in_timed_run": {k: after[k] - before[k] for k in after},
            **step_numbers(times, stages, tokens)}  # fmt: skip


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("torch", "triton", "transformers"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} -")
    return ", ".join(found)


def device_name(args) -> str:
    if args.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def stage_cell(stage: str, seconds: float, row: dict) -> str:
    """``update_actor 120.3 (55%, floor 60.1)``: seconds, share of the step, the floor."""
    floor = row.get("floor_s", {}).get(stage)
    at_floor = f", floor {floor:.1f}" if floor else ""
    return f"{stage} {seconds:.1f} ({100 * seconds / row['step_s']:.0f}%{at_floor})"


def report(args, rows: list[dict]) -> list[str]:
    """The table (a row per prompt count), its flatness, and the published comparison."""
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    timing = timing_text(args)
    lines = [
        f"NeMo-RL grpo-llama3.1-8b-instruct-2n8g shape on 1 x {device_name(args)}, "
        f"{versions()}, {today}",
        f"{args.model} (random weights), {args.samples} generations per prompt, "
        f"{args.prompt_len} + {new_tokens(args)} tokens per sequence (every response to its "
        f"maximum), KL 0.01 to the reference, s/step: {timing}",
        "tokens/s/GPU = prompt + response tokens of a step / (s/step x GPUs), NeMo-RL's definition",
        "KV rows: the full-length sequences the memory plan's KV cache holds at once "
        "(rollout.gpu_memory_utilization=auto: 0.9 of the memory free in generation)",
        "| prompts | sequences | AdamW on | s/step | tokens/s/GPU | peak GiB | KV rows "
        "| stages: s (share, floor s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "problems" in r:
            lines.append(f"| {r['prompts']} | {r['sequences']} | does not fit | - | - | - | - "
                         f"| {' '.join(r['problems'])[:300]} |")  # fmt: skip
            continue
        stages = ", ".join(stage_cell(k, v, r) for k, v in r["stage_s"].items())
        lines.append(f"| {r['prompts']} | {r['sequences']} | {r['optimizer']} "
                     f"| {r['step_s']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} "
                     f"| {r['peak_gib']:.1f} | {r['kv_sequences'] or '-'} | {stages} |")  # fmt: skip
    ran = [r for r in rows if "step_s" in r]
    if ran:
        compiled = "; ".join(f"{r['prompts']} prompts: {compiled_text(r)}" for r in ran)
        lines.append(f"compiled during the timed run (its build and steps): {compiled}")
    if len(ran) > 1:
        rates = [r["tokens_per_s_per_gpu"] for r in ran]
        lines.append(f"flatness: tokens/s/GPU from {min(rates):,.0f} to {max(rates):,.0f} "
                     f"({100 * (max(rates) / min(rates) - 1):.1f}% apart) over "
                     f"{ran[0]['prompts']}..{ran[-1]['prompts']} prompts")  # fmt: skip
    if ran:
        ours = ran[-1]["tokens_per_s_per_gpu"]
        for name, (rate, step_s) in PUBLISHED.items():
            at = f" at {step_s} s/step" if step_s else ""
            lines.append(f"NeMo-RL {name}: {rate:,} tokens/s/GPU{at} on 16 H100s; "
                         f"here {ours:,.0f} ({ours / rate:.2f}x)")  # fmt: skip
    lines += [
        "differences: an H200 (4.8 TB/s of HBM, 141 GB) against H100s (3.35 TB/s, 80 GB), the "
        "same dense bf16 peak; 1 GPU against 16 (no tensor- or data-parallel communication "
        "here); random weights: every response runs to the sequence limit, where the recipe's "
        "end at EOS (fewer, shorter decode steps per sequence there); "
        f"{ran[-1]['prompts'] if ran else '-'} prompts a step against 64; {args.prompt_len}-token "
        "random prompts against OpenMathInstruct-2's; the old-log-prob pass skipped on-policy "
        "here.",
    ]
    return lines


def timing_text(args) -> str:
    """What s/step is: a warm step, or one that includes compilation."""
    warm = (f"after a warm-up run of {args.warmup_steps} step(s) at {args.warmup_sequence_len} "
            "tokens per sequence in the same process, ") if args.warmup_steps else ""  # fmt: skip
    if args.steps > 1:
        return f"{warm}median of steps 2..{args.steps}"
    if args.warmup_steps:
        return f"{warm}the one timed step"
    return "the one step, compilation included"


def compiled_text(row: dict) -> str:
    """``0 torch.compile graphs traced, 3 new engine timing choices`` (a traced graph may
    still load its compiled code from Inductor's cache under trainer.cache_dir)."""
    done = row["compiled_in_timed_run"]
    return (f"{done['compiled_graphs']} torch.compile graphs traced, {done['engine_choices']} "
            "new engine timing choices")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3.1-8b", help="a preset or a model directory")
    parser.add_argument("--prompts", type=int, nargs="+", default=[8],
                        help="prompts per step; several: one run each (flatness)")  # fmt: skip
    parser.add_argument("--samples", type=int, default=32, help="generations per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--sequence-len", type=int, default=4096,
                        help="prompt + response tokens of every sequence")  # fmt: skip
    parser.add_argument("--micro-tokens", default="auto",
                        help="actor.max_tokens_per_gpu (auto: the memory plan's)")  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=1, help="GRPO steps (2+: the first is warm-up)"
    )
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="steps of a warm-up run before each timed run (same process)")  # fmt: skip
    parser.add_argument("--warmup-sequence-len", type=int, default=512,
                        help="prompt + response tokens of the warm-up run's sequences")  # fmt: skip
    parser.add_argument("--override", action="append", default=[], help="a config key=value")
    parser.add_argument("--device", default=None, help="trainer.device (cpu: a logic test)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="check the plan against a GPU of this size (default: the visible one)")  # fmt: skip
    parser.add_argument("--host-memory-gib", type=float, default=None,
                        help="check the plan against this much free host memory")  # fmt: skip
    parser.add_argument("--json", default=None)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.micro_tokens != "auto":
        args.micro_tokens = int(args.micro_tokens)
    if args.sequence_len <= args.prompt_len:
        parser.error("--sequence-len must exceed --prompt-len (it counts the prompt)")
    if args.warmup_steps and args.warmup_sequence_len <= args.prompt_len:
        parser.error("--warmup-sequence-len must exceed --prompt-len (it counts the prompt)")
    rows = []
    for prompts in args.prompts:  # each printed as it ends: a later one that dies leaves these
        rows.append(run_prompts(args, prompts))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "all_steps_s"}), flush=True)
    print("\n".join(report(args, rows)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
