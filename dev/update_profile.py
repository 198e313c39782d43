"""Where the actor update's time goes, against its floor: one `ActorLearner.update` of the
GRPO-vs-TRL workload profiled, its GPU kernel time grouped by kind, with each log-prob head.

    python dev/update_profile.py                                   # H200: 0.5b, ~2 min
    python dev/update_profile.py --preset qwen2.5-1.5b --micro-tokens 30720
    python dev/update_profile.py --device cpu --preset tiny --prompts 2 --samples 2 \
        --prompt-len 8 --new-tokens 8 --micro-tokens 64

The update is the real one (fp32 masters, bf16 autocast, the PPO loss, one AdamW step per
batch, the memory plan's defaults of benchmarks/grpo_vs_trl.py: no gradient checkpointing,
compiled layers on CUDA). Per head (model.fused_logprob_head on, then off), one warm-up
update, then one timed and profiled: its wall seconds, the floor (hybridflow/trainer/
stage_floors.py: 3 forwards of matmul FLOPs at the GPU's bf16 peak) and the fraction, the
kernel time by kind (matmuls, attention, the log-prob head's kernels, compiled
elementwise/norm kernels, eager elementwise and casts, the optimizer, copies) and the GPU's
idle time (wall minus busy). On the CPU the kinds group the operators' own CPU time.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import time

import torch

# The first matching pattern names a kernel's (or a CPU operator's) kind.
KINDS = [
    ("log-prob head", r"_forward_kernel|_grad_tile_kernel|_stats_kernel|_grad_kernel"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|wgmma|aten::(mm|addmm|bmm|matmul|linear)"),
    ("optimizer", r"multi_tensor|adam"),
    ("compiled elementwise / norm", r"^triton_"),
    ("copies", r"memcpy|memset|copy|aten::(to|_to_copy|copy_|cat|index|gather|scatter)"),
    ("eager elementwise", r"elementwise|reduce|aten::"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def group_times(events: list[tuple[str, float]]) -> dict[str, float]:
    """(name, µs) -> {kind: µs}, in KINDS order, kinds without time left out."""
    totals: dict[str, float] = {}
    for name, us in events:
        kind = kind_of(name)
        totals[kind] = totals.get(kind, 0.0) + us
    order = [k for k, _ in KINDS] + ["other"]
    return {k: totals[k] for k in order if totals.get(k)}


def workload(args, vocab: int):
    """The GRPO-vs-TRL batch: full prompts and responses (no EOS), random advantages, old
    log-probs near a random model's own (-log V) so that the clip leaves gradients."""
    import math

    from hybridflow.protocol import Batch

    rows = args.prompts * args.samples
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 10, (rows, args.prompt_len), generator=g)
    responses = torch.randint(10, vocab - 10, (rows, args.new_tokens), generator=g)
    mask = torch.ones(rows, args.new_tokens)
    return Batch({
        "prompts": prompts,
        "responses": responses,
        "attention_mask": torch.ones(rows, args.prompt_len + args.new_tokens, dtype=torch.long),
        "response_mask": mask,
        "advantages": torch.randn(rows, args.new_tokens, generator=g),
        "old_logprobs": -math.log(vocab) - torch.rand(rows, args.new_tokens, generator=g),
    })  # fmt: skip


def update_floor(args, device: torch.device) -> float | None:
    from hybridflow.trainer.observe.metrics import peak_flops_per_gpu
    from hybridflow.trainer.plan.architecture import model_architecture
    from hybridflow.trainer.plan.stage_floors import StepShape, forward_floor

    peak = peak_flops_per_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if peak is None:
        return None
    shape = StepShape(args.prompts, args.samples, args.prompt_len, args.new_tokens)
    return 3 * forward_floor(model_architecture(args.preset), shape, peak)


def profile_head(args, fused: bool, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from hybridflow.config import ActorConfig, ModelConfig
    from hybridflow.learners import ActorLearner
    from hybridflow.models import load_model

    cuda = device.type == "cuda"
    model = load_model(args.preset, dtype=torch.float32, device=device)
    model_cfg = ModelConfig(path=args.preset, fused_logprob_head=fused,
                            compile=cuda and not args.no_compile, gradient_checkpointing=False)  # fmt: skip
    actor_cfg = ActorConfig(lr=1e-6, ppo_mini_batch_size=args.prompts,
                            max_tokens_per_gpu=args.micro_tokens)  # fmt: skip
    actor = ActorLearner(model, actor_cfg, total_steps=10, device=device, model_cfg=model_cfg,
                         rollout_n=args.samples, max_response_length=args.new_tokens)  # fmt: skip
    batch = workload(args, model.config.vocab_size)
    actor.update(batch)  # warm-up: compilation, kernel tuning, optimizer state
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        actor.update(batch)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if cuda:
        events = [(e.key, e.self_device_time_total) for e in prof.key_averages()
                  if e.self_device_time_total > 0 and e.device_type.name == "CUDA"]  # fmt: skip
    else:
        events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()
                  if e.key.startswith("aten::")]  # fmt: skip
    kinds = group_times(events)
    del actor, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    busy_s = sum(kinds.values()) / 1e6
    return {"head": "fused" if fused else "chunked", "wall_s": wall,
            "kinds_s": {k: v / 1e6 for k, v in kinds.items()},
            "idle_s": max(0.0, wall - busy_s) if cuda else None}  # fmt: skip


def table(args, rows: list[dict], floor: float | None) -> list[str]:
    kinds = list(dict.fromkeys(k for r in rows for k in r["kinds_s"]))
    lines = [
        f"actor update, {args.preset}, {args.prompts} x {args.samples} of {args.prompt_len} + "
        f"{args.new_tokens} tokens, {args.micro_tokens:,}-token micro-batches, "
        f"{torch.cuda.get_device_name() if args.device != 'cpu' else 'cpu'}, torch "
        f"{torch.__version__}; floor: " + (f"{floor:.3f} s" if floor else "unknown"),
        "| head | update s | % of floor | " + " | ".join(kinds) + " | GPU idle |",
        "|---|---|---|" + "---|" * len(kinds) + "---|",
    ]
    for r in rows:
        share = f"{100 * floor / r['wall_s']:.0f}%" if floor else "-"
        cells = " | ".join(f"{r['kinds_s'].get(k, 0.0):.3f}" for k in kinds)
        idle = f"{r['idle_s']:.3f}" if r["idle_s"] is not None else "-"
        lines.append(f"| {r['head']} | {r['wall_s']:.3f} | {share} | {cells} | {idle} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-tokens", type=int, default=65536)
    parser.add_argument("--heads", nargs="+", choices=["fused", "chunked"],
                        default=["fused", "chunked"])  # fmt: skip
    parser.add_argument("--no-compile", action="store_true", help="eager decoder layers")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = [profile_head(args, head == "fused", device) for head in args.heads]
    floor = update_floor(args, device)
    print("\n".join(table(args, rows, floor)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor_s": floor, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
