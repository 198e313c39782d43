"""`python benchmarks/grpo_vs_trl.py`: GRPO s/step and tokens/s, hybridflow vs TRL's GRPOTrainer.

Both run the same workload in one process run; results: docs/performance.md, End-to-end
GRPO vs TRL and 2-GPU scaling.

    python benchmarks/grpo_vs_trl.py --which both            # one GPU: the workload below
    python benchmarks/grpo_vs_trl.py --which trl --preset tiny --prompts 4 --samples 2 \
        --prompt-len 8 --new-tokens 8 --steps 2                 # CPU smoke test
    python benchmarks/grpo_vs_trl.py --which hybridflow --scaling 1 2   # 2 H200s: scaling
    python benchmarks/grpo_vs_trl.py --which hybridflow --scaling 1 2 --device cpu \
        --preset tiny --prompts 2 --samples 2 --prompt-len 8 --new-tokens 8 --steps 2

Default workload: a `qwen2.5-0.5b`-shaped model with random weights, 128 prompts × 8
samples, 128-token prompts, 256 new tokens forced (no early stop), bf16, gradient
checkpointing in TRL (hybridflow's, and its update's token budget, as its memory plan decides
for the GPU: `model.gradient_checkpointing=auto`, `--hf-micro-tokens auto`; --override and a
number force them), lr 1e-6, no reference model
(beta 0), one optimizer step per generation batch, 3 steps with the first excluded. Both sides get the same random-token prompts and
a reward that scores random numbers (so advantages and gradients are non-zero).

TRL generates with its own `model.generate` (its vLLM mode is not used).
Prints a table: seconds per step, tokens/s (prompt + response tokens), peak GPU memory.

A vision-language preset (``qwen2.5-vl-7b``, ``tiny-vl``) trains on prompts with images
(grpo_vl.py): --images-per-prompt random pictures of the --image-size sizes (Geometry3K-like
by default) before the text, the same ids and pixels on both sides; TRL gets them as an
``images`` column through transformers' Qwen2.5-VL processor, and both freeze the vision
tower. benchmarks/vision_7b.sh: the 7B commands for one GPU.

    python benchmarks/grpo_vs_trl.py --which both --device cpu --preset tiny-vl --prompts 2 \
        --samples 2 --prompt-len 6 --new-tokens 5 --steps 2 --image-size 32x32,48x64

``--gpus N`` runs the hybridflow side on N GPUs (``local`` backend: one worker process per
GPU, FSDP2-sharded actor, a rollout engine per GPU, prompts split over the ranks) with
``--prompts`` prompts per GPU. ``--scaling 1 2`` runs each GPU count in a fresh process at
that equal per-GPU work and prints step time, tokens/s, tokens/s per GPU, scaling efficiency
(per-GPU tokens/s over the 1-GPU run's), peak memory of each GPU and the stage breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import grpo_vl  # noqa: E402
from grpo_model import build_hf_model_dir, load_word_tokenizer, random_prompts  # noqa: E402
from grpo_report import (  # noqa: E402
    add_scaling_efficiency,
    mean_prompt_length,
    scaling_table,
    step_summary,
)
from grpo_trl import run_trl  # noqa: E402


def hybridflow_overrides(args) -> tuple[str, ...]:
    """hybridflow's settings: gradient checkpointing as the memory plan decides for this GPU
    (as `hybridflow train` does; TRL's side checkpoints), then --override."""
    return ("model.gradient_checkpointing=auto", *args.override)


def resolved_config(model_dir: str, args, prompt_len: int | None = None):
    """The hybridflow side's config as its run resolves it (the plan's checkpointing and
    token budgets for the visible GPU, or --override's); ``prompt_len``: the longest
    prompt with its image tokens (default --prompt-len)."""
    from hybridflow.bench.grpo_steps import bench_config
    from hybridflow.trainer.plan.memory_check import memory_defaults

    cfg = bench_config(model_dir, prompts=args.prompts * args.gpus, samples=args.samples,
                       prompt_len=prompt_len or args.prompt_len, new_tokens=args.new_tokens,
                       micro_batch_tokens=args.hf_micro_tokens, gpus=args.gpus,
                       overrides=hybridflow_overrides(args))  # fmt: skip
    return memory_defaults(cfg, log=lambda line: None)


def resolved_checkpointing(model_dir: str, args, prompt_len: int | None = None) -> bool:
    """Whether the hybridflow side recomputes activations (the plan's choice, or --override)."""
    return bool(resolved_config(model_dir, args, prompt_len).model.gradient_checkpointing)


def micro_tokens(text: str) -> int | str:
    """--hf-micro-tokens: a number of tokens, or auto (the memory plan picks it)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens or auto") from None


def run_hybridflow(model_dir: str, prompts: list[list[int]], args, made=None) -> dict:
    """The hybridflow side on ``args.gpus`` GPUs; ``prompts`` holds ``args.prompts`` per GPU
    (equal per-GPU work: the global batch grows with the GPU count); ``made``
    (grpo_vl.image_prompts): the prompts with their images instead. Each step's time and
    stages go to stderr as it ends (a run cut short says how far it got)."""
    from hybridflow.bench.common import bench_reporter
    from hybridflow.bench.grpo_steps import time_grpo_steps

    progress = bench_reporter()
    try:
        times, peaks, breakdown = time_grpo_steps(
            model_path=model_dir,
            prompts=prompts if made is None else made.prompts,
            images=None if made is None else made.images,
            samples_per_prompt=args.samples,
            new_tokens=args.new_tokens,
            steps=args.steps,
            micro_batch_tokens=args.hf_micro_tokens,
            gpus=args.gpus,
            tokenizer=load_word_tokenizer(model_dir),
            overrides=hybridflow_overrides(args),
            progress=progress,
        )
    finally:
        progress.close()
    name = f"hybridflow {args.gpus}GPU" + "".join(f" {o}" for o in args.override)
    out = step_summary(name, times, args, max(peaks, default=float("nan")), gpus=args.gpus,
                   prompt_tokens=mean_prompt_length(made))  # fmt: skip
    out["peak_gib_per_gpu"] = peaks
    out["breakdown"] = breakdown
    return out


def run_scaling(model_dir: str, args) -> list[dict]:
    """hybridflow on each GPU count of ``args.scaling``, each in a fresh process (the GPUs
    start empty: the rollout's KV cache is sized from free memory), at equal per-GPU work."""
    results = []
    for gpus in args.scaling:
        out_json = os.path.join(tempfile.mkdtemp(prefix="bench-scaling-"), "r.json")
        command = [
            sys.executable, __file__, "--which", "hybridflow", "--gpus", str(gpus),
            "--preset", args.preset, "--prompts", str(args.prompts),
            "--samples", str(args.samples), "--prompt-len", str(args.prompt_len),
            "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
            "--hf-micro-tokens", str(args.hf_micro_tokens), "--model-dir", model_dir,
            "--json", out_json, *_image_arguments(args),
            *(f"--override={o}" for o in args.override),
        ]  # fmt: skip
        print(f"\n=== hybridflow on {gpus} GPU(s) ===", flush=True)
        try:
            subprocess.run(command, check=True, timeout=args.run_timeout)
            results += json.load(open(out_json))
        except (subprocess.SubprocessError, OSError) as error:  # keep the other GPU counts
            results.append({"name": f"hybridflow {gpus}GPU", "gpus": gpus, "error": repr(error)})
    return results


def _image_arguments(args) -> list[str]:
    if args.images_per_prompt is None:
        return []
    return ["--images-per-prompt", str(args.images_per_prompt),
            "--image-size", grpo_vl.format_image_sizes(args.image_size)]  # fmt: skip


def _stage_floors(model_dir: str, args, device_name: str, made=None) -> dict[str, float]:
    """Each stage's floor for this workload on this GPU ({} on a CPU or an unknown GPU);
    with images, of the language model over the prompts' mean length (the encoder's work
    is not in it)."""
    from hybridflow.trainer.observe.metrics import peak_flops_per_gpu
    from hybridflow.trainer.plan.architecture import model_architecture
    from hybridflow.trainer.plan.stage_floors import StepShape, peak_bandwidth, stage_floors

    architecture = model_architecture(model_dir)
    if architecture is None:
        return {}
    prompt_len = round(mean_prompt_length(made) or args.prompt_len)
    shape = StepShape(args.prompts, args.samples, prompt_len, args.new_tokens)
    recompute = resolved_checkpointing(model_dir, args, _longest(made))
    return stage_floors(architecture, shape, peak_flops_per_gpu(device_name),
                        peak_bandwidth(device_name), recompute=recompute)  # fmt: skip


def _longest(made) -> int | None:
    return None if made is None else made.summary()["prompt_tokens"]["max"]


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def workload(model_dir: str, args):
    """(the text prompts' ids, grpo_vl.image_prompts of them or None): random ids below a
    vision-language model's vision tokens, with --images-per-prompt images (default: 1 for
    such a model, none for a text model)."""
    from hybridflow.bench.image_prompts import text_id_limit
    from hybridflow.trainer.plan.architecture import model_architecture

    architecture = model_architecture(model_dir)
    texts = random_prompts(args.prompts * args.gpus, args.prompt_len, text_id_limit(architecture))
    count = args.images_per_prompt
    if architecture.vision is None:
        if count:
            raise ValueError(f"--images-per-prompt {count}: {model_dir} holds a text model (no "
                             "vision encoder); drop it, or bench a vision-language preset")  # fmt: skip
        return texts, None
    count = 1 if count is None else count
    made = grpo_vl.image_prompts(model_dir, texts, count, args.image_size) if count else None
    return texts, made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--which", choices=["both", "trl", "hybridflow"], default="both")
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trl-micro-batch", type=int, default=32, help="TRL per-device micro-batch")
    p.add_argument("--hf-micro-tokens", type=micro_tokens, default="auto",
                   help="hybridflow's update token budget (auto: its memory plan picks it)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write results here")
    p.add_argument("--model-dir", default=None, help="reuse (or create) the random model here")
    p.add_argument("--override", action="append", default=[], help="hybridflow config override")
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs for the hybridflow side (>1: local backend, FSDP2, one rollout engine per "
        "GPU); --prompts is per GPU",
    )
    p.add_argument(
        "--scaling",
        type=int,
        nargs="+",
        default=None,
        help="hybridflow only: run each GPU count (e.g. 1 2) in a fresh process at equal "
        "per-GPU work and print scaling efficiency",
    )
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per --scaling run")
    p.add_argument("--images-per-prompt", type=grpo_vl.images_per_prompt, default=None,
                   help="a vision-language preset's random images before each prompt's text "
                   "(default: 1 for one; grpo_vl.py)")  # fmt: skip
    p.add_argument("--image-size", type=grpo_vl.parse_image_sizes,
                   default=grpo_vl.GEO3K_IMAGE_SIZES, metavar="WxH[,WxH...]",
                   help="the images' sizes in pixels, given to the prompts' images in turn "
                   "(default: Geometry3K-like, "
                   f"{grpo_vl.format_image_sizes(grpo_vl.GEO3K_IMAGE_SIZES)})")  # fmt: skip
    p.add_argument(
        "--device", default=None, help="cpu: run the hybridflow workers on CPU (smoke test)"
    )
    args = p.parse_args()
    if args.device:
        args.override = [f"trainer.device={args.device}", *args.override]
    if (args.gpus > 1 or args.scaling) and args.which != "hybridflow":
        p.error("--gpus > 1 and --scaling measure hybridflow alone: add --which hybridflow")

    model_dir = args.model_dir or tempfile.mkdtemp(prefix="bench-model-")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        build_hf_model_dir(args.preset, model_dir)
    if args.scaling:
        results = run_scaling(model_dir, args)
        add_scaling_efficiency(results)
        print(
            f"\nhybridflow GRPO scaling, {args.preset}, {args.prompts} prompts/GPU × "
            f"{args.samples} samples, {args.prompt_len}+{args.new_tokens} tokens, "
            f"{_device_name()}, torch {torch.__version__}"
        )
        print("\n".join(scaling_table(results)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    # args.prompts per GPU; the first args.prompts are the same whatever the GPU count.
    try:
        prompts, made = workload(model_dir, args)
    except ValueError as error:
        p.error(str(error))
    results = []
    if args.which in ("both", "hybridflow"):
        results.append(run_hybridflow(model_dir, prompts, args, made))
    if args.which in ("both", "trl"):
        results.append(run_trl(model_dir, prompts, args, made))

    dev = _device_name()
    print(
        f"\nGRPO step, {args.preset}, {args.prompts} prompts (per GPU) × {args.samples} samples, "
        f"{args.prompt_len}+{args.new_tokens} tokens, {dev}, torch {torch.__version__}"
    )
    if made is not None:
        print(f"prompts: {grpo_vl.describe(made, args.image_size)} before the text tokens")
    print(f"{'system':<22}{'s/step':>10}{'tokens/s':>12}{'peak GiB':>10}  steps")
    for r in results:
        steps = " ".join(f"{t:.2f}" for t in r["all_steps_s"])
        print(
            f"{r['name']:<22}{r['step_s']:>10.2f}{r['tokens_per_s']:>12.0f}{r['peak_gib']:>10.1f}  {steps}"
        )
    if len(results) == 2:
        print(f"speed-up hybridflow / TRL: {results[1]['step_s'] / results[0]['step_s']:.2f}×")
    if results and "breakdown" in results[0]:
        breakdown = results[0]["breakdown"]
        floors = _stage_floors(model_dir, args, dev, made)
        results[0]["floors"] = floors
        resolved = resolved_config(model_dir, args, _longest(made))
        checkpointing = "on" if resolved.model.gradient_checkpointing else "off"
        print(f"hybridflow breakdown (mean of timed steps, s; gradient checkpointing "
              f"{checkpointing}, {resolved.actor.max_tokens_per_gpu:,}-token update micro-"
              f"batches; floor: at the GPU's peak, hybridflow/trainer/plan/stage_floors.py):")  # fmt: skip
        step = breakdown["timing_s/step"]
        for k, v in breakdown.items():
            floor = (
                f"   floor {floors[k]:.3f} ({100 * floors[k] / v:.0f}% of it)"
                if k in floors
                else ""
            )
            print(f"  {k:<28}{v:>8.3f}{100 * v / step:>7.1f}%{floor}")
        stages = sum(v for k, v in breakdown.items() if k != "timing_s/step")
        print(
            f"  {'controller (step - stages)':<28}{step - stages:>8.3f}{100 * (step - stages) / step:>7.1f}%"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
