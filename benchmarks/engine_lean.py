"""The lean decode layers' parts (engine/lean.py) against the split path's, one kernel at a
time, as CUDA-graph replays at the benchmark's decode shapes (operands cycled through copies so
L2 holds none of the weights or cached K/V, as in a real step). Variants alternate over
`--rounds` rounds; medians are printed.

- attention: plain (q/k/v biased by the matmul) against 1/rms and the bias in the kernel
  (NORM), over the tiles the tuner picks from;
- SiLU*up: plain against 1/rms per row, at several pairs per program;
- add+RMSNorm (what lean removes), o_proj and down: F.linear against addmm_ into the residual.

    PYTHONPATH=. python benchmarks/engine_lean.py --json $OUT/lean.json   # H200, ~1 min
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from engine_attention import decode_operands  # benchmarks/, the script's own folder

from hybridflow.engine import attention_kernels, kernels
from hybridflow.engine.gemm import graph_time_us

CASES = [  # name, rows, hidden, intermediate, q heads, kv heads, head dim, cached length
    ("1.5b", 256, 1536, 8960, 12, 2, 128, 256),
    ("0.5b", 1024, 896, 4864, 14, 2, 64, 256),
    ("0.5b", 256, 896, 4864, 14, 2, 64, 256),
]
TILES = {64: [(64, 4, 3), (128, 4, 2), (64, 4, 2)], 128: [(32, 4, 2), (64, 4, 2)]}


class _Norm:
    def __init__(self, hidden, device):
        self.weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
        self.eps = 1e-6


def _cycled(fn, copies):
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % copies
        fn(state["i"])

    return call


def bench_case(name, rows, hidden, inner, nh, nkv, d, length, rounds) -> dict:
    dev, dt = "cuda", torch.bfloat16
    caches, cos, sin, pos, slots, max_len = decode_operands(rows, nkv, d, length)
    copies = len(caches)
    qkv = torch.randn(rows, (nh + 2 * nkv) * d, device=dev, dtype=dt)
    q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([nh * d, nkv * d, nkv * d], dim=-1))
    bias = torch.randn(qkv.shape[1], device=dev, dtype=dt)
    residual = torch.randn(rows, hidden, device=dev, dtype=dt)

    def attention(config, norm):
        def run(i):
            kc, vc = caches[i]
            attention_kernels._attention(
                q, k, v, cos, sin, pos, kc, vc, slots, max_len, 1, config=config,
                norm=(residual, 1e-6, bias) if norm else None,
            )  # fmt: skip

        return _cycled(run, copies)

    variants = {}
    for config in TILES[d]:
        variants[f"attention plain {config}"] = attention(config, False)
        variants[f"attention norm {config}"] = attention(config, True)
    product = torch.randn(rows, 2 * inner, device=dev, dtype=dt)
    for block in (512, 1024, 2048):
        variants[f"silu plain {block}"] = (
            lambda block=block: kernels.silu_mul_pairs(product, block=block)
        )  # fmt: skip
        variants[f"silu norm {block}"] = (
            lambda block=block: kernels.silu_mul_pairs(product, (residual, 1e-6), block)
        )  # fmt: skip
    delta = torch.randn_like(residual)
    norm = _Norm(hidden, dev)
    variants["add_rms_norm"] = lambda: kernels.add_rms_norm(residual, delta, norm, False)
    for label, depth in (("o_proj", nh * d), ("down", inner)):
        weight_copies = max(2, -(-100_000_000 // (hidden * depth * 2)))
        weights = [torch.randn(hidden, depth, device=dev, dtype=dt) / depth**0.5
                   for _ in range(weight_copies)]  # fmt: skip
        x = torch.randn(rows, depth, device=dev, dtype=dt)
        variants[f"{label} linear"] = _cycled(lambda i, x=x, w=weights: F.linear(x, w[i]),
                                              weight_copies)  # fmt: skip
        variants[f"{label} addmm_"] = _cycled(
            lambda i, x=x, w=weights: residual.addmm_(x, w[i].t()), weight_copies
        )  # fmt: skip
    times: dict[str, list[float]] = {key: [] for key in variants}
    for _ in range(rounds):
        for key, fn in variants.items():
            times[key].append(graph_time_us(fn, calls=4 * copies))
    return {key: round(statistics.median(t), 2) for key, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {}
    for case in CASES:
        label = f"{case[0]}/{case[1]}"
        results[label] = bench_case(*case, rounds=args.rounds)
        print(f"\n{label}\n| part | us |\n|---|---|", flush=True)
        for key, us in results[label].items():
            print(f"| {key} | {us} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
