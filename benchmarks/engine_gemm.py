"""Decode-shape matmuls timed the way the engine runs them: as CUDA-graph replays, with one
weight copy per layer so L2 holds none of them (a real step reads every other layer's weights
in between), on the shapes of qwen2.5-0.5b / 1.5b at 256 and 1024 rows.

    PYTHONPATH=. python benchmarks/engine_gemm.py --out $OUT          # H200, ~2-4 min

Candidates per shape:
- cublas      F.linear(x, W, b)                           (the engine's default)
- cublas_t    x @ W^T with W^T stored [K, N] contiguous    (other cuBLAS kernel choice)
- cublaslt    F.linear under preferred_blas_library("cublaslt")
- triton      gemm.gemm_nt, every config x split-K count (split-K: fp32 partials; the
              reduce is folded into the next add+RMSNorm in the engine, so it is reported
              separately as "+reduce" = a torch sum over the splits)
- tma         the same tiles loaded through TMA tensor descriptors (gemm.TMA = True); the
              "triton" rows then run with gemm.TMA = False (per-thread pointer loads)
- triton-persistent (--persistent: instead of the two rows above) gemm_persistent's tiles
              at 1 and 2 programs per SM
- kind "silu": gate_up followed by silu(gate) * up. cuBLAS rows add the separate silu_mul
  kernel; Triton rows use the interleaved-pairs epilogue (one kernel, [M, I] output).

Prints a table (us per call, effective HBM TB/s of the weight bytes) and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time

import torch
import torch.nn.functional as F

SHAPES = {
    # name: (hidden, intermediate, q_size, kv_size)
    "qwen2.5-0.5b": (896, 4864, 896, 128),
    "qwen2.5-1.5b": (1536, 8960, 1536, 256),
}

TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 32, 128, 4, 3),
    (128, 64, 64, 4, 4),
    (128, 64, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 32, 128, 4, 3),
    (64, 64, 128, 4, 3),
    (256, 64, 64, 8, 3),
    (128, 128, 128, 8, 2),
    # deeper pipelines: most of K in flight at once (cuBLAS's skinny kernels keep ~15 stages)
    (64, 32, 64, 4, 8),
    (64, 64, 64, 4, 7),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 5),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
]
SPLITS = [1, 2, 4]
PERSISTENT_TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M)
    (64, 128, 64, 4, 4, 8),
    (128, 128, 64, 8, 3, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 4, 8),
]


def graph_time_us(calls, reps: int = 20) -> float:
    """Capture `calls` (list of thunks) in one CUDA graph, replay `reps` times -> us per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up / compile outside capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * len(calls))


def shapes_for(model: str):
    hidden, inner, q_size, kv_size = SHAPES[model]
    return {
        "qkv": (q_size + 2 * kv_size, hidden, True, False),
        "o_proj": (hidden, q_size, False, False),
        "gate_up": (2 * inner, hidden, False, True),
        "down": (hidden, inner, False, False),
        "lm_head": (151936, hidden, False, False),
    }


def bench_shape(rows: int, cols: int, depth: int, bias: bool, silu: bool, quick: bool,
                tma_modes=(False, True), persistent: bool = False) -> dict:  # fmt: skip
    from hybridflow.engine import gemm, kernels
    from hybridflow.engine.gemm_persistent import gemm_persistent

    dtype, dev = torch.bfloat16, "cuda"
    weight_bytes = cols * depth * 2
    copies = max(2, min(24, math.ceil(300e6 / weight_bytes)))
    weights = [torch.randn(cols, depth, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
    weights_t = [w.t().contiguous() for w in weights]
    biases = [torch.randn(cols, device=dev, dtype=dtype) if bias else None for _ in weights]
    x = torch.randn(rows, depth, device=dev, dtype=dtype)
    results: dict[str, float] = {}

    def cublas_call(w, wt, b, transposed: bool):
        def call():
            if transposed:
                y = torch.addmm(b, x, wt) if b is not None else torch.mm(x, wt)
            else:
                y = F.linear(x, w, b)
            if silu:  # the engine's cuBLAS path: [M, 2I] product, then its own kernel
                y = kernels.silu_mul(*y.split(cols // 2, dim=-1))
            return y

        return call

    def cublas_calls(transposed: bool):
        return [cublas_call(*args, transposed) for args in zip(weights, weights_t, biases)]

    results["cublas"] = graph_time_us(cublas_calls(False))
    results["cublas_t"] = graph_time_us(cublas_calls(True))
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        results["cublaslt"] = graph_time_us(cublas_calls(False))
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")

    tiles = [] if persistent else TILES[:3] if quick else TILES
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for tile, per_sm in itertools.product(PERSISTENT_TILES if persistent else [], (1, 2)):
        if tile[0] > max(64, rows):
            continue
        name = f"triton-persistent{tile}x{per_sm}"
        calls = [
            (lambda w=w, b=b, t=tile, p=per_sm: gemm_persistent(
                x, w, b, config=t, programs=sms * p, silu_pairs=silu))
            for w, b in zip(weights, biases)
        ]  # fmt: skip
        try:
            results[name] = graph_time_us(calls)
        except Exception as error:  # out of shared memory etc.
            results[name] = float("nan")
            print(f"  {name}: {type(error).__name__}: {str(error)[:80]}", flush=True)
    for tma, tile, splits in itertools.product(tma_modes, tiles, SPLITS):
        block_m, block_n, block_k = tile[:3]
        if block_m > max(64, rows) or (silu or bias) and splits > 1:
            continue
        if depth % (splits * block_k):
            continue
        gemm.TMA = tma  # read when the call is captured
        name = f"{'tma' if tma else 'triton'}{tile}x{splits}"
        calls = [
            (lambda w=w, b=b, t=tile, s=splits: gemm.gemm_nt(
                x, w, b, config=t, splits=s, silu_pairs=silu))
            for w, b in zip(weights, biases)
        ]  # fmt: skip
        try:
            results[name] = graph_time_us(calls)
            if splits > 1:
                reduce_calls = [(lambda f=f: f().sum(0).to(dtype)) for f in calls]
                results[name + "+reduce"] = graph_time_us(reduce_calls)
        except Exception as error:  # out of shared memory etc.
            results[name] = float("nan")
            print(f"  {name}: {type(error).__name__}: {str(error)[:80]}", flush=True)
    gemm.TMA = None
    return {"us": results, "weight_bytes": weight_bytes, "copies": copies}


def check_correctness() -> dict:
    from hybridflow.engine import gemm

    torch.manual_seed(0)
    x = torch.randn(256, 896, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1152, 896, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(1152, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, w, b).float()
    errs = {}
    for tile in TILES:
        out = gemm.gemm_nt(x, w, b, config=tile)
        errs[str(tile)] = (out.float() - ref).abs().max().item()
        if 896 % (4 * tile[2]) == 0:
            part = gemm.gemm_nt(x, w, config=tile, splits=4)
            errs[str(tile) + "x4"] = (part.sum(0) - F.linear(x, w).float()).abs().max().item()
    g, u = w[:576], w[576:]
    wi = gemm.interleave_pairs(g, u)
    ref = F.silu(F.linear(x, g)) * F.linear(x, u)
    out = gemm.gemm_nt(x, wi, config=TILES[0], silu_pairs=True)
    errs["silu_pairs"] = (out.float() - ref.float()).abs().max().item()
    return errs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gemm_bench"))
    parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    parser.add_argument("--rows", default="256,1024")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ops", default="qkv,o_proj,gate_up,down,lm_head")
    parser.add_argument("--persistent", action="store_true",
                        help="time gemm_persistent's tiles instead of gemm_nt's")  # fmt: skip
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not args.persistent:  # (tests/engine/test_kernels.py checks gemm_persistent)
        out["correctness_max_abs"] = check_correctness()
        print("correctness", json.dumps(out["correctness_max_abs"]), flush=True)
    lines = ["| model | rows | op | N x K | cublas | cublas_t | cublaslt | best triton | config "
             "| best tma | config | TB/s cublas | TB/s best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    results = []
    for model in args.models.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            for op, (cols, depth, bias, silu) in shapes_for(model).items():
                if op not in args.ops.split(","):
                    continue
                start = time.time()
                res = bench_shape(rows, cols, depth, bias, silu, args.quick,
                                  persistent=args.persistent)  # fmt: skip
                us = res["us"]
                triton_rows = {k: v for k, v in us.items() if k.startswith("triton")
                               and not math.isnan(v)}  # fmt: skip
                tma_rows = {k: v for k, v in us.items() if k.startswith("tma")
                            and not math.isnan(v)}  # fmt: skip
                # split-K partial times exclude the reduce (the engine folds it elsewhere)
                best = min(triton_rows, key=triton_rows.get) if triton_rows else None
                best_tma = min(tma_rows, key=tma_rows.get) if tma_rows else None
                fastest = min([us["cublas"], us["cublas_t"], *triton_rows.values(),
                               *tma_rows.values()])  # fmt: skip
                gb = res["weight_bytes"] / 1e9
                line = (f"| {model} | {rows} | {op} | {cols}x{depth} | {us['cublas']:.1f} | "
                        f"{us['cublas_t']:.1f} | {us.get('cublaslt', float('nan')):.1f} | "
                        f"{triton_rows.get(best, float('nan')):.1f} | {best} | "
                        f"{tma_rows.get(best_tma, float('nan')):.1f} | {best_tma} | "
                        f"{gb / us['cublas'] * 1e3:.2f} | {gb / fastest * 1e3:.2f} |")  # fmt: skip
                print(line, f"({time.time() - start:.0f}s)", flush=True)
                lines.append(line)
                results.append({"model": model, "rows": rows, "op": op, **res})
    table = "\n".join(lines)
    print(table)
    out["results"] = results
    with open(os.path.join(args.out, "gemm_bench.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, "gemm_table.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
