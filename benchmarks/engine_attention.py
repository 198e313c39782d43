"""Decode attention (RoPE + cache store fused) timed as CUDA-graph replays over tiles, grid
orders and sequence splits, at the benchmark's decode shapes; prints achieved KV bandwidth.

    PYTHONPATH=. python benchmarks/engine_attention.py --out $OUT   # H200, ~1 min
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from hybridflow.engine import attention_kernels
from hybridflow.engine.gemm import graph_time_us

CASES = [  # (name, rows, q heads, kv heads, head dim, cached length)
    ("0.5b", 256, 14, 2, 64, 256),
    ("0.5b", 1024, 14, 2, 64, 256),
    ("1.5b", 256, 12, 2, 128, 256),
]
CONFIGS = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3),
           (64, 8, 3), (128, 8, 3), (256, 8, 2)]  # fmt: skip


def bench_case(name, rows, nh, nkv, d, length) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    max_len = length + 128
    # several caches, cycled, so L2 (50 MB) holds none of them, as in a real step
    kv_bytes = 2 * rows * length * nkv * d * 2
    copies = max(1, -(-150_000_000 // kv_bytes))

    def cache(layout):  # [slots, S, nkv, D] views of token- or head-major storage
        if layout == "head":
            return torch.randn(rows + 1, nkv, max_len, d, device=dev, dtype=dt).transpose(1, 2)
        return torch.randn(rows + 1, max_len, nkv, d, device=dev, dtype=dt)

    caches = {
        layout: [(cache(layout), cache(layout)) for _ in range(copies)]
        for layout in ("token", "head")
    }
    q = torch.randn(rows, nh, d, device=dev, dtype=dt)
    k = torch.randn(rows, nkv, d, device=dev, dtype=dt)
    v = torch.randn(rows, nkv, d, device=dev, dtype=dt)
    cos = torch.randn(max_len, d, device=dev, dtype=dt)
    sin = torch.randn(max_len, d, device=dev, dtype=dt)
    pos = torch.full((rows,), length, device=dev, dtype=torch.int64)
    slots = torch.randperm(rows, device=dev)
    results = []
    for layout, config, major, splits in itertools.product(
        ("token", "head"), CONFIGS, [False, True], [1, 2]
    ):
        if config[0] > max_len // splits:
            continue

        def call(config=config, major=major, splits=splits, state={"i": 0}, layout=layout):  # noqa: B006
            state["i"] = (state["i"] + 1) % copies
            kc, vc = caches[layout][state["i"]]
            attention_kernels._attention(q, k, v, cos, sin, pos, kc, vc, slots, max_len, splits,
                               config=config, head_major=major)  # fmt: skip

        try:
            us = graph_time_us(call, calls=4 * copies)
        except Exception as error:  # out of shared memory etc.
            print(name, rows, config, major, splits, type(error).__name__, flush=True)
            continue
        results.append({"case": name, "rows": rows, "layout": layout, "config": config,
                        "head_major": major,
                        "splits": splits, "us": round(us, 2),
                        "TBps": round(kv_bytes / us / 1e6, 2)})  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/attn"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    for case in CASES:
        rows = bench_case(*case)
        results += rows
        best = min(rows, key=lambda r: r["us"])
        print("BEST", json.dumps(best), flush=True)
        for layout, major, splits in itertools.product(("token", "head"), (False, True), (1, 2)):
            sub = [r for r in rows if (r["layout"], r["head_major"], r["splits"])
                   == (layout, major, splits)]  # fmt: skip
            if sub:
                b = min(sub, key=lambda r: r["us"])
                print(f"  {layout}-major cache, grid head_major={major}, splits {splits}: "
                      f"{b['config']} {b['us']} us {b['TBps']} TB/s", flush=True)  # fmt: skip
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
