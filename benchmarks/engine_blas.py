"""cuBLAS settings at the decode step's matmul shapes: F.linear timed as CUDA-graph replays
(weights cycled through copies so L2 holds none, as in a real step) under the BLAS library
and workspace this process was started with. Run once per setting; the workspace variables
are read when CUDA initialises:

    python benchmarks/engine_blas.py                                   # torch's defaults
    CUBLAS_WORKSPACE_CONFIG=:65536:2 python benchmarks/engine_blas.py  # 64 MiB cuBLAS workspace
    TORCH_CUBLASLT_WORKSPACE_SIZE=65536 python benchmarks/engine_blas.py --lib cublaslt
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from hybridflow.engine.gemm import graph_time_us

SHAPES = {  # name: (rows, out features, in features) at the decode cases
    "1.5b/256 qkv": (256, 2048, 1536),
    "1.5b/256 o_proj": (256, 1536, 1536),
    "1.5b/256 gate_up": (256, 17920, 1536),
    "1.5b/256 down": (256, 1536, 8960),
    "1.5b/256 lm_head": (256, 151936, 1536),
    "0.5b/256 down": (256, 896, 4864),
    "0.5b/1024 qkv": (1024, 1152, 896),
    "0.5b/1024 down": (1024, 896, 4864),
    "0.5b/1024 lm_head": (1024, 151936, 896),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", default="default", choices=["default", "cublas", "cublaslt"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.lib != "default":
        torch.backends.cuda.preferred_blas_library(args.lib)
    setting = {
        "lib": str(torch.backends.cuda.preferred_blas_library()),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "TORCH_CUBLASLT_WORKSPACE_SIZE": os.environ.get("TORCH_CUBLASLT_WORKSPACE_SIZE"),
    }
    results = {}
    for name, (rows, cols, depth) in SHAPES.items():
        copies = max(2, -(-100_000_000 // (cols * depth * 2)))
        weights = [torch.randn(cols, depth, device="cuda", dtype=torch.bfloat16)
                   for _ in range(copies)]  # fmt: skip
        x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
        state = {"i": 0}

        def call(weights=weights, x=x, state=state):
            state["i"] = (state["i"] + 1) % len(weights)
            F.linear(x, weights[state["i"]])

        results[name] = round(graph_time_us(call, calls=2 * copies), 2)
        del weights
    print(json.dumps(setting))
    print("| shape | us |\n|---|---|")
    for name, us in results.items():
        print(f"| {name} | {us} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setting": setting, "us": results}, f, indent=1)


if __name__ == "__main__":
    main()
