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
import random
import subprocess
import sys
import tempfile
import time

import torch


def build_hf_model_dir(preset: str, out_dir: str, seed: int = 0) -> str:
    """Random-weight HF checkpoint of the preset's shape, plus a word-level tokenizer whose
    vocabulary covers every id (token i is spelled ``w{i}``), so text round-trips exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from hybridflow.models import load_model

    torch.manual_seed(seed)
    model = load_model(preset, dtype=torch.float32, device="cpu")
    model.save_pretrained(out_dir)
    vocab_size = model.config.vocab_size
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=f"w{vocab_size - 1}", pad_token=f"w{vocab_size - 2}"
    )
    fast.save_pretrained(out_dir)
    # sanity: transformers reads what we wrote
    AutoConfig.from_pretrained(out_dir)
    del model
    _ = AutoModelForCausalLM  # imported to fail early if transformers is broken
    return out_dir


def load_word_tokenizer(model_dir: str):
    """The word-level tokenizer written by build_hf_model_dir. (AutoTokenizer would pick the
    model type's own tokenizer class, which re-tokenizes ``w123`` differently.)"""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # avoid the last ids (eos / pad of the word-level tokenizer)
    return [[rng.randrange(10, vocab_size - 10) for _ in range(length)] for _ in range(n)]


def run_trl(model_dir: str, prompts: list[list[int]], args) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = load_word_tokenizer(model_dir)
    texts = [" ".join(f"w{i}" for i in p) for p in prompts]
    assert len(tok(texts[0])["input_ids"]) == args.prompt_len, (
        "prompt must tokenize to prompt-len ids"
    )
    n_prompts_total = args.prompts * args.steps
    ds = Dataset.from_dict({"prompt": (texts * args.steps)[:n_prompts_total]})

    def random_reward(completions, **kwargs):
        return [random.random() for _ in completions]

    cuda = torch.cuda.is_available()
    samples = args.prompts * args.samples
    micro = min(args.trl_micro_batch, samples)
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro,
        steps_per_generation=samples // micro,  # one optimizer step per generation batch
        num_generations=args.samples,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        learning_rate=1e-6,
        beta=0.0,
        num_iterations=1,
        bf16=cuda,
        gradient_checkpointing=True,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=not cuda,
        shuffle_dataset=False,
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa"
    )

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=random_reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[StepTimer()],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    del trainer, model
    if cuda:
        torch.cuda.empty_cache()
    return _summary("TRL " + _version("trl"), times, args, peak)


def hybridflow_overrides(args) -> tuple[str, ...]:
    """hybridflow's settings: gradient checkpointing as the memory plan decides for this GPU
    (as `hybridflow train` does; TRL's side checkpoints), then --override."""
    return ("model.gradient_checkpointing=auto", *args.override)


def resolved_config(model_dir: str, args):
    """The hybridflow side's config as its run resolves it (the plan's checkpointing and
    token budgets for the visible GPU, or --override's)."""
    from hybridflow.bench.grpo_steps import bench_config
    from hybridflow.trainer.plan.memory_check import memory_defaults

    cfg = bench_config(model_dir, prompts=args.prompts * args.gpus, samples=args.samples,
                       prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                       micro_batch_tokens=args.hf_micro_tokens, gpus=args.gpus,
                       overrides=hybridflow_overrides(args))  # fmt: skip
    return memory_defaults(cfg, log=lambda line: None)


def resolved_checkpointing(model_dir: str, args) -> bool:
    """Whether the hybridflow side recomputes activations (the plan's choice, or --override)."""
    return bool(resolved_config(model_dir, args).model.gradient_checkpointing)


def micro_tokens(text: str) -> int | str:
    """--hf-micro-tokens: a number of tokens, or auto (the memory plan picks it)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens or auto") from None


def run_hybridflow(model_dir: str, prompts: list[list[int]], args) -> dict:
    """The hybridflow side on ``args.gpus`` GPUs; ``prompts`` holds ``args.prompts`` per GPU
    (equal per-GPU work: the global batch grows with the GPU count)."""
    from hybridflow.bench.grpo_steps import time_grpo_steps

    times, peaks, breakdown = time_grpo_steps(
        model_path=model_dir,
        prompts=prompts,
        samples_per_prompt=args.samples,
        new_tokens=args.new_tokens,
        steps=args.steps,
        micro_batch_tokens=args.hf_micro_tokens,
        gpus=args.gpus,
        tokenizer=load_word_tokenizer(model_dir),
        overrides=hybridflow_overrides(args),
    )
    name = f"hybridflow {args.gpus}GPU" + "".join(f" {o}" for o in args.override)
    out = _summary(name, times, args, max(peaks, default=float("nan")), gpus=args.gpus)
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
            "--json", out_json,
            *(f"--override={o}" for o in args.override),
        ]  # fmt: skip
        print(f"\n=== hybridflow on {gpus} GPU(s) ===", flush=True)
        try:
            subprocess.run(command, check=True, timeout=args.run_timeout)
            results += json.load(open(out_json))
        except (subprocess.SubprocessError, OSError) as error:  # keep the other GPU counts
            results.append({"name": f"hybridflow {gpus}GPU", "gpus": gpus, "error": repr(error)})
    return results


def add_scaling_efficiency(results: list[dict]) -> None:
    """``scaling_efficiency``: per-GPU tokens/s over the 1-GPU run's (equal per-GPU work, so
    also 1-GPU step time / N-GPU step time); NaN without a 1-GPU run."""
    base = next((r for r in results if r.get("gpus") == 1 and "error" not in r), None)
    for r in results:
        if "error" not in r:
            r["scaling_efficiency"] = (
                r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else float("nan")
            )


def scaling_table(results: list[dict]) -> list[str]:
    """Step time, tokens/s (total and per GPU), scaling efficiency, peak memory per GPU and
    the stage breakdown of each run (``add_scaling_efficiency`` first)."""
    lines = [
        f"{'GPUs':>4}{'prompts':>9}{'s/step':>9}{'tokens/s':>11}{'tok/s/GPU':>11}"
        f"{'scaling':>9}  peak GiB per GPU"
    ]
    for r in results:
        if "error" in r:
            lines.append(f"{r['gpus']:>4}  failed: {r['error'][:200]}")
            continue
        peaks = " ".join(f"{p:.1f}" for p in r.get("peak_gib_per_gpu", [])) or "n/a"
        lines.append(
            f"{r['gpus']:>4}{r['prompts']:>9}{r['step_s']:>9.2f}{r['tokens_per_s']:>11.0f}"
            f"{r['tokens_per_s_per_gpu']:>11.0f}{100 * r['scaling_efficiency']:>8.1f}%  {peaks}"
        )
    ok = [r for r in results if "breakdown" in r]
    if ok:
        lines.append("stage breakdown (s, mean of timed steps): " + " | ".join(
            f"{r['gpus']} GPU" for r in ok))  # fmt: skip
        for key in dict.fromkeys(k for r in ok for k in r["breakdown"]):  # union, in order
            values = "".join(f"{r['breakdown'].get(key, 0.0):>10.3f}" for r in ok)
            lines.append(f"  {key:<28}{values}")
        overhead = "".join(f"{_controller_s(r['breakdown']):>10.3f}" for r in ok)
        lines.append(f"  {'controller (step - stages)':<28}{overhead}")
    return lines


def _controller_s(breakdown: dict[str, float]) -> float:
    return breakdown["timing_s/step"] - sum(v for k, v in breakdown.items() if k != "timing_s/step")


def _version(pkg: str) -> str:
    from importlib.metadata import version

    try:
        return version(pkg)
    except Exception:
        return "?"


def _summary(name: str, times: list[float], args, peak_gib: float, gpus: int = 1) -> dict:
    """``args.prompts`` prompts per GPU; tokens count prompt + response tokens."""
    timed = times[1:] if len(times) > 1 else times  # first step excluded (warm-up)
    step_s = sum(timed) / len(timed)
    tokens = gpus * args.prompts * args.samples * (args.prompt_len + args.new_tokens)
    return {
        "name": name,
        "gpus": gpus,
        "prompts": gpus * args.prompts,
        "step_s": step_s,
        "all_steps_s": times,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_gpu": tokens / step_s / gpus,
        "peak_gib": peak_gib,
    }


def _stage_floors(model_dir: str, args, device_name: str) -> dict[str, float]:
    """Each stage's floor for this workload on this GPU ({} on a CPU or an unknown GPU)."""
    from hybridflow.trainer.observe.metrics import peak_flops_per_gpu
    from hybridflow.trainer.plan.architecture import model_architecture
    from hybridflow.trainer.plan.stage_floors import StepShape, peak_bandwidth, stage_floors

    architecture = model_architecture(model_dir)
    if architecture is None:
        return {}
    shape = StepShape(args.prompts, args.samples, args.prompt_len, args.new_tokens)
    recompute = resolved_checkpointing(model_dir, args)
    return stage_floors(architecture, shape, peak_flops_per_gpu(device_name),
                        peak_bandwidth(device_name), recompute=recompute)  # fmt: skip


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


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
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    # args.prompts per GPU; the first args.prompts are the same whatever the GPU count.
    prompts = random_prompts(args.prompts * args.gpus, args.prompt_len, vocab)
    results = []
    if args.which in ("both", "hybridflow"):
        results.append(run_hybridflow(model_dir, prompts, args))
    if args.which in ("both", "trl"):
        results.append(run_trl(model_dir, prompts, args))

    dev = _device_name()
    print(
        f"\nGRPO step, {args.preset}, {args.prompts} prompts (per GPU) × {args.samples} samples, "
        f"{args.prompt_len}+{args.new_tokens} tokens, {dev}, torch {torch.__version__}"
    )
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
        floors = _stage_floors(model_dir, args, dev)
        results[0]["floors"] = floors
        resolved = resolved_config(model_dir, args)
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
