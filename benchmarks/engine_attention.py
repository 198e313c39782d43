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
import triton
import triton.language as tl

from hybridflow.engine import attention_kernels
from hybridflow.engine.gemm import graph_time_us

CASES = [  # (name, rows, q heads, kv heads, head dim, cached length)
    ("0.5b", 256, 14, 2, 64, 256),
    ("0.5b", 1024, 14, 2, 64, 256),
    ("0.5b", 1024, 14, 2, 64, 130),  # a generate() call's first steps (where the tile is tuned)
    ("0.5b", 1024, 14, 2, 64, 380),  # and its last
    ("1.5b", 256, 12, 2, 128, 256),
]
CONFIGS = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3),
           (64, 8, 3), (128, 8, 3), (256, 8, 2)]  # fmt: skip


@triton.jit
def _read_kernel(kc_ptr, vc_ptr, slot_ptr, out_ptr, stride_slot, stride_pos, stride_head,
                 length, D: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The attention kernel's reads and nothing else: program (row, kv head) sums K and V
    over positions [0, length) of its slot (the sum is stored so the loads stay)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    base = tl.load(slot_ptr + row).to(tl.int64) * stride_slot + head * stride_head
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        offs = base + n[:, None].to(tl.int64) * stride_pos + d[None, :]
        mask = (n < length)[:, None]
        acc += tl.load(kc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(vc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (row * tl.num_programs(1) + head) * D + d, tl.sum(acc, axis=0))


@triton.jit
def _read_persistent_kernel(kc_ptr, vc_ptr, slot_ptr, out_ptr, stride_slot, stride_pos,
                            stride_head, items, NKV: tl.constexpr, TILES: tl.constexpr,
                            D: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The same reads from a persistent grid: program p takes items (row, kv head) p, p + P,
    ... and streams their tiles as one flattened loop, so the next item's loads are in flight
    while the current one finishes (no per-program start-up latency between items)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    mine = tl.cdiv(items - pid, programs)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for t in range(0, mine * TILES):
        item = pid + (t // TILES) * programs
        tile = t % TILES
        row = item // NKV
        head = item % NKV
        base = tl.load(slot_ptr + row).to(tl.int64) * stride_slot + head * stride_head
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs = base + n[:, None].to(tl.int64) * stride_pos + d[None, :]
        acc += tl.load(kc_ptr + offs).to(tl.float32)
        acc += tl.load(vc_ptr + offs).to(tl.float32)
        if tile == TILES - 1:
            tl.store(out_ptr + item * D + d, tl.sum(acc, axis=0))
            acc = tl.zeros([BLOCK_N, D], tl.float32)


@triton.jit
def _read_rows_kernel(kc_ptr, vc_ptr, slot_ptr, out_ptr, stride_slot, stride_pos, length,
                      W: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The reads of a program per row for all its kv heads (token-major cache: a position's
    heads are W = kv heads x D contiguous elements): half the programs of _read_kernel, each
    position one contiguous run instead of one per head."""
    row = tl.program_id(0)
    base = tl.load(slot_ptr + row).to(tl.int64) * stride_slot
    w = tl.arange(0, W)
    acc = tl.zeros([BLOCK_N, W], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        offs = base + n[:, None].to(tl.int64) * stride_pos + w[None, :]
        mask = (n < length)[:, None]
        acc += tl.load(kc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(vc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * W + w, tl.sum(acc, axis=0))


def read_rows_floor(key_cache, value_cache, slots, length, block_n, warps=4, stages=3):
    rows, (nkv, d) = slots.shape[0], key_cache.shape[2:]
    assert key_cache.stride(2) == d, "token-major cache"
    out = torch.empty(rows, nkv, d, device=key_cache.device)
    _read_rows_kernel[(rows,)](
        key_cache, value_cache, slots, out, key_cache.stride(0), key_cache.stride(1), length,
        W=nkv * d, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def row_reads(lengths=(256, 130, 380)) -> list[dict]:
    """Read floors at the issue's n = 1 shapes: a program per (row, kv head) as the attention
    kernel runs, against a program per row reading all its kv heads (is the per-head grid,
    512 programs at 1.5b/256, leaving bandwidth behind?), next to the tuned attention. The
    tuner keeps the tile it chose at a case's first length, so the middle one comes first,
    as in the engine (graphs.TUNE_AT_MIDDLE); session 13's call4 tuned at 130 and showed the
    0.5b/256 attention 28-38% over the floor at 256-380, which call5 (tuned at 256) did not."""
    results = []
    for name, rows, nh, nkv, d in [("1.5b", 256, 12, 2, 128), ("0.5b", 256, 14, 2, 64),
                                   ("0.5b", 1024, 14, 2, 64)]:  # fmt: skip
        for length in lengths:
            results.append(_row_reads_case(name, rows, nh, nkv, d, length))
    return results


def _row_reads_case(name, rows, nh, nkv, d, length) -> dict:
    dev, dt = "cuda", torch.bfloat16
    max_len = length + 128
    kv_bytes = 2 * rows * length * nkv * d * 2
    copies = max(1, -(-150_000_000 // kv_bytes))
    caches = [tuple(torch.randn(rows + 1, max_len, nkv, d, device=dev, dtype=dt)
                    for _ in range(2)) for _ in range(copies)]  # fmt: skip
    slots = torch.randperm(rows, device=dev)
    q = torch.randn(rows, nh, d, device=dev, dtype=dt)
    k, v = (torch.randn(rows, nkv, d, device=dev, dtype=dt) for _ in range(2))
    cos, sin = (torch.randn(max_len, d, device=dev, dtype=dt) for _ in range(2))
    pos = torch.full((rows,), length, device=dev, dtype=torch.int64)
    state = {"i": 0}

    def timed(fn, *args) -> float:  # fn(kc, vc, *args), cycling through the cache copies
        def call():
            state["i"] = (state["i"] + 1) % copies
            fn(*caches[state["i"]], *args)

        return graph_time_us(call)

    def attention(kc, vc):
        attention_kernels._attention(q, k, v, cos, sin, pos, kc, vc, slots, max_len, 1)

    times = {"attention (tuned)": timed(attention)}
    for block_n, warps in itertools.product((64, 128), (4, 8)):
        times[f"per head {block_n} w{warps}"] = timed(read_floor, slots, length, block_n, warps)
    for block_n, warps, stages in itertools.product((32, 64), (4, 8), (2, 3)):
        if block_n * nkv * d <= 16384:  # the [BLOCK_N, W] fp32 accumulator in registers
            times[f"per row {block_n} w{warps} s{stages}"] = timed(
                read_rows_floor, slots, length, block_n, warps, stages)  # fmt: skip
    best = {kind: min((t, key) for key, t in times.items() if key.startswith(kind))
            for kind in ("attention", "per head", "per row")}  # fmt: skip
    print(f"{name}/{rows} at {length}: " + "; ".join(
        f"{kind} {t:.2f} us ({kv_bytes / t / 1e6:.2f} TB/s, {key})"
        for kind, (t, key) in best.items()), flush=True)  # fmt: skip
    return {"case": name, "rows": rows, "length": length,
            "us": {key: round(t, 2) for key, t in times.items()}}  # fmt: skip


def read_floor_persistent(key_cache, value_cache, slots, length, block_n, programs, stages=3):
    rows, (nkv, d) = slots.shape[0], key_cache.shape[2:]
    out = torch.empty(rows, nkv, d, device=key_cache.device)
    _read_persistent_kernel[(programs,)](
        key_cache, value_cache, slots, out, key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), rows * nkv, NKV=nkv, TILES=length // block_n, D=d,
        BLOCK_N=block_n, num_warps=4, num_stages=stages,
    )  # fmt: skip
    return out


def read_floor(key_cache, value_cache, slots, length, block_n, warps=4):
    """Launch _read_kernel over caches [slots, S, nkv, D] (any layout) -> [rows, nkv, D]."""
    rows, (nkv, d) = slots.shape[0], key_cache.shape[2:]
    out = torch.empty(rows, nkv, d, device=key_cache.device)
    _read_kernel[(rows, nkv)](
        key_cache, value_cache, slots, out, key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), length, D=d, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return out


def bench_case(name, rows, nh, nkv, d, length) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    max_len = length + 128
    # several caches, cycled, so L2 (50 MB) holds none of them, as in a real step
    kv_bytes = 2 * rows * length * nkv * d * 2
    copies = max(1, -(-150_000_000 // kv_bytes))

    def record(layout, config, us, major=False, splits=1) -> dict:
        return {"case": name, "rows": rows, "layout": layout, "config": config,
                "head_major": major, "splits": splits, "us": round(us, 2),
                "TBps": round(kv_bytes / us / 1e6, 2)}  # fmt: skip

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
        results.append(record(layout, config, us, major, splits))
    # Floors: the same bytes read by a kernel that only reads (same grid), and by torch.sum
    # over contiguous memory of that size.
    for layout, block_n in itertools.product(("token", "head"), (64, 128)):

        def read(state={"i": 0}, layout=layout, block_n=block_n):  # noqa: B006
            state["i"] = (state["i"] + 1) % copies
            kc, vc = caches[layout][state["i"]]
            read_floor(kc, vc, slots, length, block_n)

        us = graph_time_us(read, calls=4 * copies)
        results.append(record(layout, f"read-only {block_n}", us))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for block_n, waves, stages in itertools.product((32, 64), (1, 2, 4), (2, 3, 4)):
        if block_n > length:
            continue

        def read_p(state={"i": 0}, block_n=block_n, waves=waves, stages=stages):  # noqa: B006
            state["i"] = (state["i"] + 1) % copies
            kc, vc = caches["token"][state["i"]]
            read_floor_persistent(kc, vc, slots, length, block_n, waves * sms, stages)

        us = graph_time_us(read_p, calls=4 * copies)
        results.append(record("token", f"read-only persistent {block_n} x{waves} s{stages}", us))
    flat = [torch.randn(kv_bytes // 2, device=dev, dtype=dt) for _ in range(copies)]

    def total(state={"i": 0}):  # noqa: B006
        state["i"] = (state["i"] + 1) % copies
        torch.sum(flat[state["i"]], dtype=torch.float32)

    us = graph_time_us(total, calls=4 * copies)
    results.append(record("contiguous", "torch.sum", us))
    return results


def store_order_ab(rounds: int = 3) -> list[dict]:
    """attention_kernels.STORE_LAST off vs on, alternated `rounds` times in one process
    (token-major cache, one split, the tiles the tuner keeps at these shapes)."""
    return [row for case in CASES for row in _store_order_case(*case, rounds)]


def decode_operands(rows, nkv, d, length, dev="cuda", dt=torch.bfloat16):
    """Random operands of a decode-attention launch at one shape, except q/k/v: token-major
    cache copies ([rows + 1, length + 128, nkv, d] key/value pairs, ~150 MB in all so a
    caller cycling through them finds none in L2), RoPE tables, every row at `length`."""
    max_len = length + 128
    kv_bytes = 2 * rows * length * nkv * d * 2
    copies = max(1, -(-150_000_000 // kv_bytes))
    caches = [tuple(torch.randn(rows + 1, max_len, nkv, d, device=dev, dtype=dt)
                    for _ in range(2)) for _ in range(copies)]  # fmt: skip
    cos, sin = (torch.randn(max_len, d, device=dev, dtype=dt) for _ in range(2))
    pos = torch.full((rows,), length, device=dev, dtype=torch.int64)
    slots = torch.randperm(rows, device=dev)
    return caches, cos, sin, pos, slots, max_len


def _store_order_case(name, rows, nh, nkv, d, length, rounds) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    caches, cos, sin, pos, slots, max_len = decode_operands(rows, nkv, d, length)
    copies = len(caches)
    q = torch.randn(rows, nh, d, device=dev, dtype=dt)
    k, v = (torch.randn(rows, nkv, d, device=dev, dtype=dt) for _ in range(2))

    def call(config, state={"i": 0}):  # noqa: B006
        state["i"] = (state["i"] + 1) % copies
        kc, vc = caches[state["i"]]
        attention_kernels._attention(q, k, v, cos, sin, pos, kc, vc, slots, max_len, 1,
                                     config=config)  # fmt: skip

    results = []
    for config in [(64, 4, 3), (128, 4, 2)] if d == 64 else [(32, 4, 2)]:
        times = {False: [], True: []}
        for _, last in itertools.product(range(rounds), (False, True)):
            attention_kernels.STORE_LAST = last
            times[last].append(graph_time_us(lambda c=config: call(c), calls=4 * copies))
        attention_kernels.STORE_LAST = None
        row = {"case": name, "rows": rows, "length": length, "config": config,
               **{f"store_last_{k}": round(sorted(t)[len(t) // 2], 2)
                  for k, t in times.items()}}  # fmt: skip
        print("STORE_LAST", json.dumps(row), flush=True)
        results.append(row)
    return results


def _time_tile(q, k, v, operands, config: tuple, store_last: bool) -> float:
    """One decode-attention launch (RoPE fused, one split) with a fixed tile, as graph
    replays cycling through the operands' cache copies (none left in L2)."""
    caches, cos, sin, pos, slots, max_len = operands
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(caches)
        kc, vc = caches[state["i"]]
        attention_kernels._attention(q, k, v, cos, sin, pos, kc, vc, slots, max_len, 1,
                                     config=config)  # fmt: skip

    attention_kernels.STORE_LAST = store_last
    try:
        return graph_time_us(call, calls=4 * len(caches))
    finally:
        attention_kernels.STORE_LAST = None


LENGTH_CASES = [  # (name, rows, q heads, kv heads, head dim): the three cases
    ("0.5b", 256, 14, 2, 64),
    ("0.5b", 1024, 14, 2, 64),
    ("1.5b", 256, 12, 2, 128),
]


def tiles_by_length(lengths=(130, 256, 380)) -> list[dict]:
    """Every tile the tuner may pick (attention_kernels._ATTENTION_CONFIGS, both store
    orders), RoPE fused, one split, timed at a call's first, middle and last lengths: does
    the tile that wins at one length win the call (the sum over lengths)?"""
    dev, dt = "cuda", torch.bfloat16
    results = []
    for name, rows, nh, nkv, d in LENGTH_CASES:
        q = torch.randn(rows, nh, d, device=dev, dtype=dt)
        k, v = (torch.randn(rows, nkv, d, device=dev, dtype=dt) for _ in range(2))
        table: dict[tuple, dict[int, float]] = {}
        for length in lengths:
            operands = decode_operands(rows, nkv, d, length)
            for c in attention_kernels._ATTENTION_CONFIGS:
                config = (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                last = c.kwargs["STORE_LAST"]
                us = _time_tile(q, k, v, operands, config, last)
                table.setdefault((*config, last), {})[length] = round(us, 2)
            del operands
        best_at = {n: min(table, key=lambda t, n=n: table[t][n]) for n in lengths}
        best_sum = min(table, key=lambda t: sum(table[t].values()))
        print(
            f"{name} {rows} rows: tile (BLOCK_N, warps, stages, STORE_LAST) -> us at "
            f"{list(lengths)}, sum"
        )
        for tile, times in sorted(table.items(), key=lambda kv: sum(kv[1].values())):
            marks = [f"best@{n}" for n in lengths if best_at[n] == tile]
            print(
                f"  {tile}: {[times[n] for n in lengths]} {sum(times.values()):.1f} "
                f"{' '.join(marks)}"
            )
        results.append({"case": name, "rows": rows, "best_at": {n: list(t) for n, t in
                        best_at.items()}, "best_sum": list(best_sum),
                        "us": {str(t): times for t, times in table.items()}})  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/attn"))
    parser.add_argument("--store-order", action="store_true",
                        help="only the A/B of attention_kernels.STORE_LAST")  # fmt: skip
    parser.add_argument(
        "--by-length",
        action="store_true",
        help="only the tuner's tiles at a call's first/middle/last lengths",
    )
    parser.add_argument("--row-reads", action="store_true",
                        help="only the read floors per (row, kv head) vs per row")  # fmt: skip
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.row_reads:
        with open(os.path.join(args.out, "row_reads.json"), "w") as f:
            json.dump(row_reads(), f, indent=1)
        return
    if args.by_length:
        with open(os.path.join(args.out, "tiles_by_length.json"), "w") as f:
            json.dump(tiles_by_length(), f, indent=1)
        return
    if args.store_order:
        with open(os.path.join(args.out, "store_order.json"), "w") as f:
            json.dump(store_order_ab(), f, indent=1)
        return
    results = []
    for case in CASES:
        rows = bench_case(*case)
        results += rows
        attention = [r for r in rows if isinstance(r["config"], tuple)]
        print("BEST", json.dumps(min(attention, key=lambda r: r["us"])), flush=True)
        for r in rows:
            if not isinstance(r["config"], tuple):
                print(f"  floor: {r['layout']} {r['config']}: {r['us']} us {r['TBps']} TB/s")
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
