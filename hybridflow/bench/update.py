"""`hybridflow bench update`: the actor's update (forward, backward, AdamW step) in bf16 against
FP8 training matmuls (actor.precision=fp8, learners/fp8_training.py), one table.

    hybridflow bench update --preset qwen2.5-1.5b --rows 64 --prompt-len 256 \
        --response-len 768 --precision bf16,fp8 --fp8-recipe rowwise,tensorwise

Each variant gets a fresh model (the same seed: the same weights) and the same batch: `rows`
samples of `prompt-len` + `response-len` tokens, one optimizer step (one mini-batch) packed
into micro-batches of at most `--max-tokens` tokens, as `hybridflow train` runs it. The time
is the median of `--steps` updates after `--warmup` (the first compiles). On the CPU the FP8
variants run torchao's emulation (a smoke test: no FP8 speed there).

Each row is printed against its floor (trainer/plan/stage_floors.update_floor: forward +
backward FLOPs at the GPU's dense peak): bf16 at the bf16 peak; FP8 with the float8 linears'
matmuls at the FP8 peak and the rest (lm_head, attention) at bf16's. "at floor" is floor /
time. No floor on a device whose peaks are unknown (the CPU).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time


def add_update_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen2.5-0.5b", help="model preset or local HF directory")
    p.add_argument("--rows", type=int, default=64, help="samples in the update's batch")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of each sample")
    p.add_argument("--response-len", type=int, default=768, help="response tokens of each")
    p.add_argument("--max-tokens", type=int, default=16384,
                   help="tokens per micro-batch (actor.max_tokens_per_gpu)")  # fmt: skip
    p.add_argument("--precision", default="bf16,fp8",
                   help="comma-separated actor.precision values to time")  # fmt: skip
    p.add_argument("--fp8-recipe", default="rowwise,tensorwise",
                   help="comma-separated actor.fp8_recipe values (each fp8 variant)")  # fmt: skip
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile each decoder layer (model.compile; auto: on CUDA)")  # fmt: skip
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each layer in the backward (model.gradient_checkpointing)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=1, help="untimed updates first")
    p.add_argument("--steps", type=int, default=3, help="timed updates")
    p.add_argument("--device", default=None, help="device to run on (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    p.add_argument("--json", default=None,
                   help="also write the results to this file (default: print only)")  # fmt: skip


def variants(precisions: str, recipes: str) -> list[tuple[str, str | None]]:
    """("bf16", None), ("fp8", "rowwise"), ... in the order given; ValueError naming a bad
    value."""
    from hybridflow.config.precision_checks import FP8_RECIPES, PRECISIONS

    out: list[tuple[str, str | None]] = []
    for precision in [p.strip() for p in precisions.split(",") if p.strip()]:
        if precision not in PRECISIONS:
            raise ValueError(f"--precision {precision!r}: use {' or '.join(PRECISIONS)}")
        if precision == "bf16":
            out.append(("bf16", None))
            continue
        for recipe in [r.strip() for r in recipes.split(",") if r.strip()]:
            if recipe not in FP8_RECIPES:
                raise ValueError(f"--fp8-recipe {recipe!r}: use {' or '.join(FP8_RECIPES)}")
            out.append(("fp8", recipe))
    if not out:
        raise ValueError("--precision names no variant: use bf16, fp8 or bf16,fp8")
    return out


def update_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    """Full-length samples with random tokens and advantages (a Batch of the update's keys;
    old_logprobs are filled in by the caller from the policy, so the PPO ratio starts at 1)."""
    import torch

    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(16, vocab, (rows, prompt_len), generator=g)
    responses = torch.randint(16, vocab, (rows, response_len), generator=g)
    return Batch({
        "prompts": prompts,
        "responses": responses,
        "attention_mask": torch.ones(rows, prompt_len + response_len, dtype=torch.long),
        "response_mask": torch.ones(rows, response_len),
        "advantages": torch.randn(rows, response_len, generator=g),
    })  # fmt: skip


def time_variant(args, device, precision: str, recipe: str | None, progress) -> dict:
    """Median seconds of ``args.steps`` updates of one variant, its tokens/s and peak memory."""
    import torch

    from hybridflow.bench.common import sync_device
    from hybridflow.config import ActorConfig, ModelConfig
    from hybridflow.learners import ActorLearner
    from hybridflow.models import load_model

    name = precision if recipe is None else f"{precision} {recipe}"
    with progress.task(f"loading {args.preset} ({name})"):
        torch.manual_seed(args.seed)
        model = load_model(args.preset, dtype=torch.float32, device=device)
    compile_on = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    actor = ActorLearner(
        model,
        ActorConfig(lr=1e-6, ppo_mini_batch_size=args.rows, max_tokens_per_gpu=args.max_tokens,
                    precision=precision, fp8_recipe=recipe or "rowwise"),
        model_cfg=ModelConfig(path=args.preset, compile=compile_on,
                              gradient_checkpointing=args.gradient_checkpointing),
        total_steps=args.warmup + args.steps,
        device=device,
        fp8_emulate=precision == "fp8" and device.type == "cpu",
    )  # fmt: skip
    batch = update_batch(args.rows, args.prompt_len, args.response_len,
                         model.config.vocab_size, args.seed)  # fmt: skip
    batch = batch.union(actor.compute_logprobs(batch))
    times = []
    updates = progress.task(f"updates ({name})", total=args.warmup + args.steps, unit="updates")
    with updates as task:
        for step in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync_device(device)
            start = time.perf_counter()
            actor.update(batch)
            sync_device(device)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
            task.advance()
    tokens = args.rows * (args.prompt_len + args.response_len)
    seconds = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    fp8_weights = sum(actor.model.get_submodule(name).weight.numel()
                      for name in actor.core.fp8_linears)  # fmt: skip
    floor = update_floor_s(args, _device_name(device), fp8_weights)
    return {"precision": precision, "fp8_recipe": recipe, "update_s": seconds,
            "tokens_per_s": tokens / seconds, "fp8_linears": len(actor.core.fp8_linears),
            "floor_s": floor, "at_floor": None if floor is None else floor / seconds,
            "peak_gib": peak, "emulated": precision == "fp8" and device.type == "cpu",
            "compiled": compile_on, "times_s": times}  # fmt: skip


def update_floor_s(args, device_name: str, fp8_weights: int) -> float | None:
    """The update's floor on ``device_name`` (stage_floors.update_floor): bf16 without
    ``fp8_weights`` (weights of the linears computing in float8), FP8 with them; None where
    the device's peaks (or its architecture's shape) are unknown."""
    from hybridflow.trainer.observe.metrics import peak_flops_per_gpu, peak_fp8_flops_per_gpu
    from hybridflow.trainer.plan.architecture import model_architecture
    from hybridflow.trainer.plan.stage_floors import StepShape, update_floor

    bf16_peak, fp8_peak = peak_flops_per_gpu(device_name), peak_fp8_flops_per_gpu(device_name)
    architecture = model_architecture(args.preset)
    if not bf16_peak or architecture is None or (fp8_weights and not fp8_peak):
        return None
    shape = StepShape(args.rows, 1, args.prompt_len, args.response_len)
    return update_floor(architecture, shape, bf16_peak, args.gradient_checkpointing,
                        fp8_weights, fp8_peak)  # fmt: skip


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def bench_update(args, progress=None) -> dict:
    import torch

    from hybridflow.progress import quiet_reporter

    progress = progress or quiet_reporter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for precision, recipe in variants(args.precision, args.fp8_recipe):
        rows.append(time_variant(args, device, precision, recipe, progress))
        gc.collect()  # the variant's model and optimizer state, before the next one loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    baseline = next((r["update_s"] for r in rows if r["precision"] == "bf16"), None)
    for row in rows:
        row["speedup_vs_bf16"] = None if baseline is None else baseline / row["update_s"]
    return {"device": _device_name(device), "preset": args.preset, "rows": args.rows,
            "tokens": args.rows * (args.prompt_len + args.response_len),
            "torch": torch.__version__, "torchao": _torchao_version(), "variants": rows}  # fmt: skip


def _torchao_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchao")
    except PackageNotFoundError:
        return None


def show_update(result: dict) -> None:
    print(f"actor update on {result['device']}: {result['preset']}, {result['rows']} samples, "
          f"{result['tokens']} tokens (torch {result['torch']}, torchao {result['torchao']})")  # fmt: skip
    print(f"{'variant':<26} {'update s':>9} {'floor s':>8} {'at floor':>8} {'tokens/s':>10} "
          f"{'vs bf16':>8} {'fp8 linears':>12} {'peak GiB':>9}")  # fmt: skip
    for row in result["variants"]:
        name = row["precision"] + (f" {row['fp8_recipe']}" if row["fp8_recipe"] else "")
        name += " (emulated)" if row["emulated"] else ""
        speedup = "-" if row["speedup_vs_bf16"] is None else f"{row['speedup_vs_bf16']:.2f}x"
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
        floor = "-" if row["floor_s"] is None else f"{row['floor_s']:.3f}"
        at_floor = "-" if row["at_floor"] is None else f"{row['at_floor']:.0%}"
        print(f"{name:<26} {row['update_s']:>9.3f} {floor:>8} {at_floor:>8} "
              f"{row['tokens_per_s']:>10.0f} {speedup:>8} {row['fp8_linears']:>12} {peak:>9}")  # fmt: skip
    print(
        "floor: forward + backward FLOPs at the GPU's dense peak; fp8 rows: the float8 "
        "linears' matmuls at the FP8 peak, the lm_head and attention at bf16's"
    )


def run_update_command(args) -> int:
    import json

    from hybridflow.bench.common import bench_reporter
    from hybridflow.errors import UserError

    try:
        variants(args.precision, args.fp8_recipe)
    except ValueError as error:
        print(f"hybridflow bench update: {error}", file=sys.stderr)
        return 2
    progress = bench_reporter()
    try:
        result = bench_update(args, progress=progress)
    except UserError as error:  # fp8 on a GPU without float8 tensor cores, torchao missing
        print(f"hybridflow bench update: {error}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    show_update(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
