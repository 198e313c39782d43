"""Shared-prefix decode attention (shared_prefix.py) against the plain kernel, as CUDA-graph
replays at GRPO-like shapes: n samples of each prompt side by side, every row `own` tokens
past its prompt. Sweeps the prefix program's tile, its splits along the prefix and the group size, and prints the time of
the row kernel alone (SHARED: its own positions) and of the whole shared attention.

    PYTHONPATH=. python benchmarks/engine_prefix.py --out $OUT   # H200, ~1 min
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from hybridflow.engine import attention_kernels, shared_prefix
from hybridflow.engine.gemm import graph_time_us

MODELS = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}  # q heads, kv heads, head dim
CASES = [  # (prompts, n, prompt length, own tokens past the prompt)
    (64, 8, 256, 128),
    (128, 8, 128, 192),
    (32, 16, 256, 128),
]
PREFIX_CONFIGS = [(64, 4, 3), (32, 4, 3), (64, 4, 2)]
SPLITS = (1, 2, 3, 4)
PROGRAMS = (132, 264, 528)
PDL = (False, True)  # shared_prefix.PDL: the prefix programs launch early and prefetch
GROUP_SIZES = (8, 16)


def operands(prompts, n, prompt_len, own, nh, nkv, d, dev="cuda", dt=torch.bfloat16):
    """Cache copies (~150 MB in all, so cycling through them finds none in L2), q/k/v of the
    new token, RoPE tables; rows of one prompt side by side in random slots."""
    rows = prompts * n
    length = prompt_len + own
    max_len = length + 64
    kv_bytes = 2 * rows * length * nkv * d * 2
    copies = max(1, -(-150_000_000 // kv_bytes))
    caches = [tuple(torch.randn(rows, max_len, nkv, d, device=dev, dtype=dt) for _ in range(2))
              for _ in range(copies)]  # fmt: skip
    cos, sin = (torch.randn(max_len, d, device=dev, dtype=dt) for _ in range(2))
    pos = torch.full((rows,), length, device=dev, dtype=torch.int64)
    slots = torch.randperm(rows, device=dev)
    q = torch.randn(rows, nh, d, device=dev, dtype=dt)
    k, v = (torch.randn(rows, nkv, d, device=dev, dtype=dt) for _ in range(2))
    return dict(caches=caches, cos=cos, sin=sin, pos=pos, slots=slots, q=q, k=k, v=v,
                max_len=max_len, rows=rows)  # fmt: skip


def timed(ops, shared=None, splits=None) -> float:
    state = {"i": 0}
    caches = ops["caches"]

    def call():
        state["i"] = (state["i"] + 1) % len(caches)
        kc, vc = caches[state["i"]]
        attention_kernels._attention(ops["q"], ops["k"], ops["v"], ops["cos"], ops["sin"],
                                     ops["pos"], kc, vc, ops["slots"], ops["max_len"], splits,
                                     shared=shared)  # fmt: skip

    return graph_time_us(call, calls=4 * len(caches))


def table_for(ops, prompts, n, prompt_len, group_rows):
    keys = [r // n for r in range(ops["rows"])]
    slots = ops["slots"].tolist()
    groups, first = shared_prefix.group_table(keys, [prompt_len] * ops["rows"], slots,
                                              ops["rows"], group_rows)  # fmt: skip
    return first.cuda(), groups.cuda()


def run(out_dir: str) -> list[dict]:
    results = []
    for model, (nh, nkv, d) in MODELS.items():
        for prompts, n, prompt_len, own in CASES:
            ops = operands(prompts, n, prompt_len, own, nh, nkv, d)
            length = prompt_len + own
            kv_gb = 2 * ops["rows"] * length * nkv * d * 2 / 1e9
            plain = timed(ops)
            # what the row kernel's share costs: a plain launch over `own` positions only
            own_only = timed(dict(ops, pos=torch.full_like(ops["pos"], own)), splits=1)
            row = {"model": model, "prompts": prompts, "n": n, "prompt_len": prompt_len,
                   "own": own, "plain_us": round(plain, 2), "own_only_us": round(own_only, 2),
                   "plain_TBps": round(kv_gb / plain * 1e6 / 1e3, 2), "shared": {}}  # fmt: skip
            print(f"{model} {prompts}x{n} prompt {prompt_len} own {own}: plain {plain:.1f} us "
                  f"({row['plain_TBps']} TB/s of KV), own positions only {own_only:.1f} us; "
                  f"auto splits {shared_prefix.prefix_splits(ops['rows'], nkv)}", flush=True)  # fmt: skip
            saved = (shared_prefix.GROUP_ROWS, shared_prefix.PREFIX_CONFIG,
                     shared_prefix.PREFIX_SPLITS, shared_prefix.PREFIX_PROGRAMS,
                     shared_prefix.PDL)  # fmt: skip
            try:
                for group_rows in GROUP_SIZES:
                    if group_rows > n:
                        continue
                    shared_prefix.GROUP_ROWS = group_rows
                    shared = table_for(ops, prompts, n, prompt_len, group_rows)
                    times = {}
                    for config, splits, programs, pdl in itertools.product(
                            PREFIX_CONFIGS, SPLITS, PROGRAMS, PDL):  # fmt: skip
                        shared_prefix.PREFIX_CONFIG = config
                        shared_prefix.PREFIX_SPLITS = splits
                        shared_prefix.PREFIX_PROGRAMS = programs
                        shared_prefix.PDL = pdl
                        key = f"{config} x{splits} p{programs}{' pdl' if pdl else ''}"
                        times[key] = round(timed(ops, shared=shared), 2)
                    best = min(times, key=times.get)
                    row["shared"][group_rows] = times
                    print(
                        f"  group {group_rows}: best {best} {times[best]:.1f} us "
                        f"({plain / times[best]:.2f}x plain); fastest five "
                        f"{sorted(times.items(), key=lambda kv: kv[1])[:5]}; by splits "
                        f"{ {sp: min(t for k, t in times.items() if f' x{sp} ' in k) for sp in SPLITS} }; "
                        f"PDL off/on {min(t for k, t in times.items() if 'pdl' not in k)} / "
                        f"{min((t for k, t in times.items() if 'pdl' in k), default=None)}",
                        flush=True,
                    )
            finally:
                (shared_prefix.GROUP_ROWS, shared_prefix.PREFIX_CONFIG,
                 shared_prefix.PREFIX_SPLITS, shared_prefix.PREFIX_PROGRAMS,
                 shared_prefix.PDL) = saved  # fmt: skip
            results.append(row)
            del ops
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "engine_prefix.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/prefix"))
    parser.add_argument("--pdl-only", action="store_true",
                        help="only the default tile, splits and programs, PDL off and on")  # fmt: skip
    args = parser.parse_args()
    if args.pdl_only:
        global PREFIX_CONFIGS, SPLITS, PROGRAMS, GROUP_SIZES
        PREFIX_CONFIGS = [shared_prefix.PREFIX_CONFIG]
        SPLITS, PROGRAMS, GROUP_SIZES = (1,), (shared_prefix.PREFIX_PROGRAMS,), (8,)
    run(args.out)


if __name__ == "__main__":
    main()
