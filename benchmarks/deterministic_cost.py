"""`python benchmarks/deterministic_cost.py`: what the deterministic FlashAttention backward
costs a training micro-batch (packed forward + backward through the model, bf16 on CUDA).

    python benchmarks/deterministic_cost.py --presets qwen2.5-0.5b qwen2.5-1.5b --lengths 384 640

Each row: one micro-batch of --tokens tokens packed from sequences of the given length,
forward_packed + the sum of the final hidden states' squares as the loss + backward; the
median of --repeats timed runs after two warm-up runs, with `model.deterministic_attention`
on and off in the same process. The flash kernels' own share is printed beside it (CUDA
events around the backward of the attention alone would perturb the timing, so the table
shows the whole micro-batch, which is what a step pays). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def time_micro_batch(model, tokens: int, length: int, repeats: int) -> float:
    """Median milliseconds of one packed forward + backward of `tokens` tokens."""
    sequences = tokens // length
    ids = torch.randint(10, 1000, (sequences * length,), device="cuda")
    positions = torch.arange(length, device="cuda").repeat(sequences)
    cu_seqlens = torch.arange(0, sequences + 1, device="cuda", dtype=torch.int32) * length
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        hidden = model.forward_packed(ids, positions, cu_seqlens, length)
        hidden.float().square().mean().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[384, 640])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from hybridflow.models import load_model

    rows = []
    for preset in args.presets:
        model = load_model(preset, dtype=torch.bfloat16, device="cuda")
        for length in args.lengths:
            timed = {}
            for deterministic in (False, True):
                model.deterministic_attention = deterministic
                timed[deterministic] = time_micro_batch(model, args.tokens, length, args.repeats)
            rows.append(dict(preset=preset, length=length, tokens=args.tokens,
                             default_ms=timed[False], deterministic_ms=timed[True],
                             cost=timed[True] / timed[False] - 1))  # fmt: skip
        del model
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| preset | sequence length | tokens | default ms | deterministic ms | cost |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['length']} | {r['tokens']} | {r['default_ms']:.1f} "
              f"| {r['deterministic_ms']:.1f} | {r['cost']:+.1%} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
