"""`python benchmarks/logprob_head.py`: the log-prob head alone, fused (models/heads/fused_head.py)
against token-chunked (models/heads/logprobs.py), on the lm_head shapes of real models.

    python benchmarks/logprob_head.py                  # one GPU: 0.5b, 1.5b, 8B heads
    python benchmarks/logprob_head.py --device cpu --presets tiny --tokens 64 --repeats 1

Per preset and head: the forward with entropy (a scoring pass: old log-probs, reference) and
the forward + backward of log-probs and entropy (the update), each as the median of --repeats
timed calls after a warm-up; TFLOP/s counts the useful matmul FLOPs (2·N·V·H forward, 6·N·V·H
forward + backward; both heads also recompute the logits in the backward); peak: memory
allocated above the inputs during the call. Gaps, on --check-tokens of the tokens against an
fp64 reference of the same bf16 inputs: the largest |log-prob| and |entropy| difference, and
the relative error of d hidden. Hidden states are random with the scale of a final norm's
output, so logits have a spread like a trained model's.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import time

import torch

from hybridflow.models import preset_config
from hybridflow.models.heads.logprobs import logprobs_from_hidden, naive_logprobs

HEADS = {"fused": True, "chunked": False}


def head_inputs(config, tokens: int, device: str, dtype: torch.dtype, seed: int = 0):
    """hidden [N, H], weight [V, H], targets [N], upstream gradients [2, N]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, config.hidden_size, generator=g).to(device, dtype)
    weight = (torch.randn(config.vocab_size, config.hidden_size, generator=g) * 0.05).to(
        device, dtype
    )
    targets = torch.randint(0, config.vocab_size, (tokens,), generator=g).to(device)
    upstream = torch.randn(2, tokens, generator=g).to(device)
    return hidden, weight, targets, upstream


def call(hidden, weight, targets, upstream, fused: bool, backward: bool):
    if not backward:
        with torch.no_grad():
            return logprobs_from_hidden(hidden, weight, targets, with_entropy=True, fused=fused)
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    logprobs, entropy = logprobs_from_hidden(
        hidden, weight, targets, with_entropy=True, fused=fused
    )
    ((logprobs * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
    return logprobs, entropy, hidden.grad


def timed(fn, device: str, warmup: int, repeats: int) -> tuple[float, float]:
    """(median seconds, peak bytes allocated above what was allocated before)."""
    cuda = device.startswith("cuda")
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return statistics.median(times), peak


def gaps(hidden, weight, targets, upstream, fused: bool) -> dict:
    """Largest log-prob / entropy difference and d hidden's relative error against fp64."""
    logprobs, entropy, grad = call(hidden, weight, targets, upstream, fused, backward=True)
    exact_hidden = hidden.detach().double().requires_grad_()
    exact = naive_logprobs(exact_hidden, weight.double(), targets)
    ((exact[0] * upstream[0]).sum() + (exact[1] * upstream[1]).sum()).backward()
    reference = exact_hidden.grad
    return {
        "logprob_gap": (logprobs.double() - exact[0]).abs().max().item(),
        "entropy_gap": (entropy.double() - exact[1]).abs().max().item(),
        "grad_hidden_rel": ((grad.double() - reference).norm() / reference.norm()).item(),
    }


def measure(args, preset: str) -> list[dict]:
    config = preset_config(preset)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    inputs = head_inputs(config, args.tokens, args.device, dtype)
    hidden, weight, targets, upstream = inputs
    k = args.check_tokens
    check = (hidden[:k], weight, targets[:k], upstream[:, :k])
    flops = 2.0 * args.tokens * config.vocab_size * config.hidden_size
    rows = []
    for head, fused in HEADS.items():
        row = {"preset": preset, "head": head, "tokens": args.tokens}
        for name, backward, useful in (("forward", False, flops), ("fwd+bwd", True, 3 * flops)):
            run = functools.partial(call, *inputs, fused, backward)
            seconds, peak = timed(run, args.device, args.warmup, args.repeats)
            row[name] = {"ms": 1e3 * seconds, "tflops": useful / seconds / 1e12,
                         "peak_gib": peak / 2**30}  # fmt: skip
        row.update(gaps(*check, fused))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(args, rows: list[dict]) -> list[str]:
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = [
        f"log-prob head, {args.tokens:,} tokens, {device}, torch {torch.__version__}, {today}",
        "| preset | head | forward ms | TFLOP/s | peak GiB | fwd+bwd ms | TFLOP/s | peak GiB "
        "| max log-prob gap | max entropy gap | d hidden rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, b = r["forward"], r["fwd+bwd"]
        lines.append(
            f"| {r['preset']} | {r['head']} | {f['ms']:.2f} | {f['tflops']:.0f} "
            f"| {f['peak_gib']:.2f} | {b['ms']:.2f} | {b['tflops']:.0f} | {b['peak_gib']:.2f} "
            f"| {r['logprob_gap']:.1e} | {r['entropy_gap']:.1e} | {r['grad_hidden_rel']:.1e} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b",
                                                         "llama3.1-8b"])  # fmt: skip
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--check-tokens", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [row for preset in args.presets for row in measure(args, preset)]
    print("\n".join(table(args, rows)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
