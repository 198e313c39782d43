"""`python benchmarks/moe_layer.py --out DIR`: one sparse layer's experts at the Qwen3-30B-A3B
shape (128 experts, top-8, 2048 -> 768): grouped GEMMs against a per-expert loop and the floor.

For each token count it times, on the same routing: the engine's Triton kernels (sort by
expert, grouped gate/up with SiLU*up, grouped down, combine: engine/kernels/experts/moe.py), the
engine's torch._grouped_mm path, the trainer's `moe_experts` with grouped GEMMs (forward, and
forward + backward) and with a per-expert loop (models/moe.py). The floor is the larger of the
touched experts' weight bytes over the measured copy bandwidth and the FLOPs over the measured
bf16 matmul rate. Each path's error against an fp32 loop is printed beside its time, and the
grouped backward's gradients against the loop's.

With --expert-share N it also times one rank's share of a tensor-parallel rollout's split
layer (experts [0, E/N): engine/tensor_parallel.py), the kernels skipping the pairs routed
to the other ranks' experts (before the all-reduce, which is not timed here).

    python benchmarks/moe_layer.py --out $OUT                 # H200: ~1 min
    python benchmarks/moe_layer.py --out $OUT --expert-share 2
    python benchmarks/moe_layer.py --device cpu --quick       # CPU dry run (tiny shape)

With --align it times the sort by expert alone (align_pairs: the decode step's per-layer
launches; beside it the former one-launch sort, moe_align_baseline.py), replayed as a CUDA
graph as the decode step runs it, and exits:

    python benchmarks/moe_layer.py --out $OUT --align --tokens 256,1024
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch

from hybridflow.models.moe import moe_experts, select_experts

SHAPE = dict(experts=128, top_k=8, hidden=2048, inner=768)  # Qwen3-30B-A3B
QUICK_SHAPE = dict(experts=8, top_k=2, hidden=64, inner=32)


def timed_ms(fn, device, rep_ms: int = 200) -> float:
    """Median milliseconds of fn(): CUDA events (triton's do_bench), or the host clock."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1000)
    return statistics.median(runs)


def ceilings(device) -> dict:
    """Measured copy bandwidth (bytes read + written per s) and bf16 matmul rate."""
    if device.type != "cuda":
        return {"bytes_per_s": 1e10, "flops_per_s": 1e11}
    src = torch.empty(2**31, dtype=torch.uint8, device=device)  # 2 GiB, far past L2
    dst = torch.empty_like(src)
    copy_ms = timed_ms(lambda: dst.copy_(src), device)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_ms = timed_ms(lambda: a @ a, device)
    return {"bytes_per_s": 2 * src.numel() / (copy_ms / 1000),
            "flops_per_s": 2 * 8192**3 / (mm_ms / 1000)}  # fmt: skip


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference).norm() / reference.norm()).item()


def engine_paths(x, ids, weights, gate_up, down) -> dict:
    """The engine's two expert paths as zero-argument calls (Triton kernels; torch's
    grouped matmul where it runs)."""
    from hybridflow.engine.kernels.experts import moe
    from hybridflow.engine.layers.moe import _pairs_grouped_mm

    ids32 = ids.to(torch.int32)
    experts, tokens = gate_up.shape[0], x.shape[0]
    block_m = moe.block_rows(tokens, ids.shape[1], experts)

    def triton_kernels():
        blocks = moe.align_pairs(ids32, experts, block_m)
        return moe.combine(moe.grouped_down(moe.grouped_gate_up(x, gate_up, blocks), down,
                                            blocks), weights)  # fmt: skip

    paths = {"engine triton": triton_kernels}
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9:
        paths["engine _grouped_mm"] = lambda: moe.combine(
            _pairs_grouped_mm(x, ids32, gate_up, down), weights
        )
    return paths


def share_rows(x, ids, weights, gate_up, down, share: int, limits: dict,
               triton_ok: bool) -> list[dict]:  # fmt: skip
    """One rank's 1/share of the experts (experts [0, E/share)): the engine's Triton kernels
    and the trainer's grouped path on the pairs routed to them, against an fp32 loop over the
    same share; the floor counts the share's touched experts and pairs only."""
    from hybridflow.engine.kernels.experts import moe

    tokens, top_k = ids.shape
    local = gate_up.shape[0] // share
    part_gate_up, part_down = gate_up[:local], down[:local]
    held = int((ids < local).sum())
    touched = int((ids.unique() < local).sum())
    hidden, inner = x.shape[1], down.shape[2]
    weight_bytes = touched * 3 * hidden * inner * x.element_size()
    flops = 2 * held * 3 * hidden * inner
    floor_ms = 1000 * max(weight_bytes / limits["bytes_per_s"], flops / limits["flops_per_s"])
    reference = moe_experts(x.float(), ids, weights, part_gate_up.float(), part_down.float(),
                            "loop", first_expert=0)  # fmt: skip
    grouped = "grouped_mm" if x.is_cuda else "loop"
    paths = {f"trainer grouped fwd, 1/{share} experts": lambda: moe_experts(
        x, ids, weights, part_gate_up, part_down, grouped, first_expert=0)}  # fmt: skip
    if triton_ok:
        ids32 = ids.to(torch.int32)
        block_m = moe.block_rows(tokens, top_k, gate_up.shape[0])  # pairs per expert: global

        def triton_share():
            blocks = moe.align_pairs(ids32, local, block_m, first_expert=0)
            act = moe.grouped_gate_up(x, part_gate_up, blocks)
            return moe.combine(moe.grouped_down(act, part_down, blocks), weights)

        paths = {f"engine triton, 1/{share} experts": triton_share, **paths}
    return [{"tokens": tokens, "path": name, "ms": timed_ms(fn, x.device), "floor_ms": floor_ms,
             "touched": touched, "rel_err": relative_error(fn(), reference)}
            for name, fn in paths.items()]  # fmt: skip


def layer_case(tokens: int, shape: dict, device, limits: dict, triton_ok: bool,
               share: int = 1) -> list[dict]:  # fmt: skip
    experts, top_k, hidden, inner = (shape[k] for k in ("experts", "top_k", "hidden", "inner"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(tokens)

    def rand(*size):
        return torch.randn(*size, device=device, generator=generator).to(dtype)

    x = rand(tokens, hidden)
    gate_up, down = rand(experts, 2 * inner, hidden) * 0.02, rand(experts, hidden, inner) * 0.02
    ids, weights = select_experts(rand(tokens, experts), top_k, True)
    touched = ids.unique().numel()
    weight_bytes = touched * 3 * hidden * inner * x.element_size()
    flops = 2 * tokens * top_k * 3 * hidden * inner
    floor_ms = 1000 * max(weight_bytes / limits["bytes_per_s"], flops / limits["flops_per_s"])
    reference = moe_experts(x.float(), ids, weights, gate_up.float(), down.float(), "loop")
    grouped = "grouped_mm" if device.type == "cuda" else "loop"
    paths = {
        "trainer grouped fwd": lambda: moe_experts(x, ids, weights, gate_up, down, grouped),
        "per-expert loop fwd": lambda: moe_experts(x, ids, weights, gate_up, down, "loop"),
    }
    if triton_ok:
        paths = {**engine_paths(x, ids, weights, gate_up, down), **paths}
    rows = []
    for name, fn in paths.items():
        ms = timed_ms(fn, device)
        rows.append({"tokens": tokens, "path": name, "ms": ms, "floor_ms": floor_ms,
                     "touched": touched, "rel_err": relative_error(fn(), reference)})  # fmt: skip
    rows += backward_rows(x, ids, weights, gate_up, down, grouped, tokens, floor_ms, device)
    if share > 1:
        rows += share_rows(x, ids, weights, gate_up, down, share, limits, triton_ok)
    return rows


def backward_rows(x, ids, weights, gate_up, down, grouped, tokens, floor_ms, device) -> list:
    """Forward + backward of the trainer's grouped path (timed), its gradients against the
    per-expert loop's (the floor: three times the forward's)."""
    leaves = [t.detach().requires_grad_() for t in (x, gate_up, down)]
    upstream = torch.randn_like(x)

    def step(backend):
        for leaf in leaves:
            leaf.grad = None
        out = moe_experts(leaves[0], ids, weights, leaves[1], leaves[2], backend)
        out.backward(upstream)
        return [leaf.grad.clone() for leaf in leaves]

    loop_grads = step("loop")
    errors = [relative_error(g, r.float()) for g, r in zip(step(grouped), loop_grads)]
    ms = timed_ms(lambda: step(grouped), device)
    return [{"tokens": tokens, "path": "trainer grouped fwd+bwd", "ms": ms,
             "floor_ms": 3 * floor_ms, "rel_err": max(errors)}]  # fmt: skip


# --sweep: (block_n, block_k, warps, stages) tried for each grouped kernel and BLOCK_M
SWEEP_TILES = [(64, 128, 4, 4), (128, 128, 4, 3), (64, 64, 4, 5), (128, 64, 4, 4),
               (64, 128, 8, 4), (32, 128, 4, 4), (128, 128, 8, 3), (64, 256, 4, 3)]  # fmt: skip
SWEEP_BLOCKS = {256: (16, 32, 64), 1024: (32, 64, 128), 4096: (64, 128), 16384: (64, 128)}


def sweep(tokens: int, shape: dict, device) -> list[dict]:
    """Each grouped kernel's time per BLOCK_M and tile (engine/kernels/experts/moe.py's TILES)."""
    from hybridflow.engine.kernels.experts import moe, routing

    experts, top_k, hidden, inner = (shape[k] for k in ("experts", "top_k", "hidden", "inner"))
    generator = torch.Generator(device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=device, generator=generator).bfloat16()
    gate_up = torch.randn(experts, 2 * inner, hidden, device=device, generator=generator)
    gate_up = (gate_up * 0.02).bfloat16()
    down = torch.randn(experts, hidden, inner, device=device, generator=generator) * 0.02
    down = down.bfloat16()
    logits = torch.randn(tokens, experts, device=device, generator=generator)
    ids, _ = routing.route_topk(logits, top_k, True)
    rows = []
    for block_m in SWEEP_BLOCKS.get(tokens, (moe.block_rows(tokens, top_k, experts),)):
        blocks = moe.align_pairs(ids, experts, block_m)
        act = moe.grouped_gate_up(x, gate_up, blocks)
        align = functools.partial(moe.align_pairs, ids, experts, block_m)
        rows.append({"tokens": tokens, "block_m": block_m, "kernel": "align",
                     "ms": timed_ms(align, device, 100)})  # fmt: skip
        for tile in SWEEP_TILES:
            for name, fn in (
                ("gate_up", functools.partial(moe.grouped_gate_up, x, gate_up, blocks, tile)),
                ("down", functools.partial(moe.grouped_down, act, down, blocks, tile)),
            ):
                try:
                    ms = timed_ms(fn, device, 100)
                except Exception as error:  # a tile past the shared memory: skip it
                    ms = float("nan")
                    print(name, block_m, tile, repr(error)[:120])
                rows.append({"tokens": tokens, "block_m": block_m, "kernel": name,
                             "tile": list(tile), "ms": ms})  # fmt: skip
    for kernel in ("gate_up", "down"):
        best = min((r for r in rows if r["kernel"] == kernel and r["ms"] == r["ms"]),
                   key=lambda r: r["ms"])  # fmt: skip
        print(f"sweep {tokens} best {kernel}: block_m {best['block_m']} tile {best['tile']} "
              f"{best['ms']:.3f} ms", flush=True)  # fmt: skip
    return rows


def graph_us(fn, device) -> float:
    """Median microseconds of fn() replayed in a CUDA graph (no launch overhead: as the
    decode step runs), or the host clock's."""
    if device.type == "cuda":
        import triton.testing

        return 1000 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return 1000 * timed_ms(fn, device)


def align_rows(tokens: int, shape: dict, device) -> list[dict]:
    """The sort by expert on the routing of random logits, all experts and one rank's half
    (first_expert, the pairs of the other half skipped): align_pairs (a count launch, then a
    placement launch), its count launch alone, and the former one-launch sort (every program
    histograms all pairs: moe_align_baseline.py), checked to give the same blocks."""
    from moe_align_baseline import histogram_align

    from hybridflow.engine.kernels.experts import moe, routing

    experts, top_k = shape["experts"], shape["top_k"]
    generator = torch.Generator(device).manual_seed(tokens)
    logits = torch.randn(tokens, experts, device=device, generator=generator)
    ids, _ = routing.route_topk(logits, top_k, True)
    pairs, block_m = tokens * top_k, moe.block_rows(tokens, top_k, experts)
    chunk = min(max(1 << (pairs - 1).bit_length(), 256), 4096)  # align_pairs' chunk
    rows = []
    for name, (count, first) in {"all": (experts, None), "1/2": (experts // 2, 0)}.items():
        counts = torch.empty(count, dtype=torch.int32, device=device)
        sorts = {
            "align_pairs": functools.partial(moe.align_pairs, ids, count, block_m, first),
            "its count launch": functools.partial(
                moe._count_kernel[(count,)], ids, counts, pairs, count, first or 0, CHUNK=chunk,
                num_warps=8 if chunk >= 2048 else 4),
            "one launch, histogram (before)": functools.partial(
                histogram_align, ids, count, block_m, first),
        }  # fmt: skip
        got, before = sorts["align_pairs"](), sorts["one launch, histogram (before)"]()
        total = int(got.total)
        assert total == int(before.total) and torch.equal(got.group_ends, before.group_ends)
        assert torch.equal(got.sorted_pairs[:total], before.sorted_pairs[:total])
        assert torch.equal(got.block_expert[: total // block_m],
                           before.block_expert[: total // block_m])  # fmt: skip
        for sort, fn in sorts.items():
            rows.append({"tokens": tokens, "pairs": pairs, "block_m": block_m,
                         "experts": name, "sort": sort, "us": graph_us(fn, device)})  # fmt: skip
    return rows


def align_table(rows: list[dict]) -> str:
    lines = ["| tokens | pairs | block_m | experts | sort | us |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['pairs']} | {r['block_m']} | {r['experts']} | "
              f"{r['sort']} | {r['us']:.1f} |" for r in rows]  # fmt: skip
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = [
        "| tokens | path | ms | floor ms | x floor | rel. error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['path']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
                     f"{r['ms'] / r['floor_ms']:.1f} | {r['rel_err']:.1e} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/moe_layer"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="a tiny shape (CPU dry run)")
    parser.add_argument("--tokens", default="256,1024,4096", help="token counts, comma-separated")
    parser.add_argument("--sweep", action="store_true",
                        help="also time each grouped kernel per block size and tile (CUDA)")  # fmt: skip
    parser.add_argument("--expert-share", type=int, default=1,
                        help="also time one rank's 1/N of the experts (rollout TP = N)")  # fmt: skip
    parser.add_argument("--align", action="store_true",
                        help="time the sort by expert (align_pairs) alone, then exit")  # fmt: skip
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    shape = QUICK_SHAPE if args.quick else SHAPE
    tokens = [8] if args.quick else [int(t) for t in args.tokens.split(",")]
    if args.align:
        rows = [row for count in tokens for row in align_rows(count, shape, device)]
        with open(os.path.join(args.out, "moe_align.json"), "w") as f:
            json.dump({"shape": shape, "rows": rows, "torch": torch.__version__}, f, indent=1)
        print(align_table(rows))
        return
    # the Triton kernels run on CUDA, or on the CPU under the interpreter
    triton_ok = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    limits = ceilings(device)
    print("ceilings", json.dumps(limits), flush=True)
    rows = []
    for count in tokens:
        rows += layer_case(count, shape, device, limits, triton_ok, args.expert_share)
        print(json.dumps(rows[-1]), flush=True)
    swept = []
    if args.sweep and device.type == "cuda":
        for count in tokens:
            swept += sweep(count, shape, device)
    result = {"shape": shape, "ceilings": limits, "rows": rows, "table": table(rows),
              "sweep": swept,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}  # fmt: skip
    with open(os.path.join(args.out, "moe_layer.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(result["table"])


if __name__ == "__main__":
    main()
