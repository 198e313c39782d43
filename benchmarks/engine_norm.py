"""add+RMSNorm kernel: rows per program x warps, as CUDA-graph replays, at decode and prefill
row counts of qwen2.5-0.5b (H = 896).

    PYTHONPATH=. python benchmarks/engine_norm.py --out $OUT   # H200, seconds
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hybridflow.engine import kernels
from hybridflow.engine.gemm import graph_time_us

SHAPES = [(256, 896), (1024, 896), (16384, 896), (256, 1536)]
VARIANTS = [(1, 4), (1, 1), (1, 2), (2, 2), (4, 4), (8, 8), (4, 1)]  # (rows/program, warps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/norm"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    for rows, hidden in SHAPES:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        d = torch.randn_like(x)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        line = {"rows": rows, "hidden": hidden}
        for per_program, warps in VARIANTS:
            line[f"{per_program}x{warps}w"] = round(graph_time_us(
                lambda p=per_program, n=warps, t=(x, d, w, out): kernels._launch_rms_norm(
                    *t, 1e-6, add=True, weighted=True, per_program=p, warps=n),
                calls=20), 2)  # fmt: skip
        print(json.dumps(line), flush=True)
        results.append(line)
    with open(os.path.join(args.out, "norm.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
