"""The gate/up + SiLU candidates DecodeMatmul times, stream-K included (matmul_choice.STREAMK
is off by default), at given shapes: the tuner's own L2-cold graph-replay times, fastest
first. No model is loaded (random operands).

    python benchmarks/engine_streamk.py                      # H200, ~30 s
    python benchmarks/engine_streamk.py --shapes 256x17920x1536
"""

from __future__ import annotations

import argparse
import json

import torch

from hybridflow.engine import matmul_choice


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="256x17920x1536,256x9728x896,1024x9728x896",
                        help="rows x N (gate/up rows, interleaved) x K, comma-separated")  # fmt: skip
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    matmul_choice.STREAMK = True
    matmul = matmul_choice.DecodeMatmul("auto")
    for shape in args.shapes.split(","):
        rows, cols, depth = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(cols, depth, device="cuda", dtype=torch.bfloat16) / depth**0.5
        matmul.gate_up_silu(x, weight)
        timings = matmul.timings[(matmul_choice._row_bucket(rows), cols, depth)]
        ranked = sorted(timings.items(), key=lambda kv: kv[1])
        print(f"{shape}: " + ", ".join(f"{k} {v}" for k, v in ranked[: args.top]), flush=True)
        best_streamk = min((v for k, v in timings.items() if "streamk" in k), default=None)
        print(f"  best stream-K {best_streamk} us, cuBLAS + silu_mul {timings.get('cublas')} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in matmul.timings.items()}, f, indent=1)


if __name__ == "__main__":
    main()
