"""Can the decode step's attention run under its matmuls? A feasibility measurement.

The decode step is a serial chain of kernels, each near its own floor (NOTES.md run 12): the
attention is bound by HBM reads while the tensor cores idle, the matmuls by the tensor cores
while HBM has room. Two half batches on two streams, the second started after the first's
first attention, could put one half's attention beside the other half's matmuls (the way
NanoFlow splits a batch into nano-batches). What it costs: each matmul runs twice at half
the rows (a 0.5b layer's weights, ~30 MB, should stay in the 50 MB L2 between the halves).

This times, as CUDA-graph replays of the engine's own layer code (forward.fused_layers, the
engine's tuned matmuls and attention) at `rows` live rows of the call's mean length:
  full            all rows, one stream (what the engine replays now)
  halves, serial  the two halves one after the other on one stream (the cost of halving)
  halves, 2 streams            both halves at once, no offset
  halves, 2 streams, offset    the second half starts after the first half's first attention
  ... , B high priority        the same with the second stream at high priority
The ratio to `full` is what an engine integration could gain at most (no lm_head/sampler).
Session 3's version of this script timed 1 vs k streams without an offset (NOTES.md run 7:
1024 rows 3077 vs 3217 us, slower) with the kernels of the day.

    python benchmarks/engine_overlap.py --preset qwen2.5-0.5b --rows 1024   # H200, ~1 min
"""

from __future__ import annotations

import argparse
import json

import torch
from engine_step import live_rows  # benchmarks/ is the script's own folder

from hybridflow.engine import Engine, SamplingParams, attention_kernels, pdl
from hybridflow.engine.bench_cli import make_prompts
from hybridflow.engine.forward import fused_layers
from hybridflow.engine.gemm import graph_time_us
from hybridflow.models import load_model


@torch.no_grad()
def overlap(preset: str, rows: int, length: int, new_tokens: int) -> dict:
    device = torch.device("cuda")
    model = load_model(preset, dtype=torch.bfloat16, device=device).eval()
    vocab = model.config.vocab_size
    engine = Engine(model, max_batch_size=rows, max_seq_len=length + new_tokens + 64)
    prompts = make_prompts(rows, length, vocab, 0)
    engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=0, ignore_eos=True))
    state, cache, rope = engine.state, engine.cache, engine.rope
    mean_length = length + new_tokens // 2
    live_rows(engine, rows, mean_length)
    max_len = cache.max_seq_len
    half = rows // 2

    def layers(begin: int, end: int, after_first_attention=None):
        positions = state.positions[begin:end]
        slots = state.row_slots[begin:end]

        def attend(index, q, k, v):
            out = attention_kernels.decode_attention_rope(
                q, k, v, rope.cos, rope.sin, positions, cache.keys[index],
                cache.values[index], slots, max_len,
            )  # fmt: skip
            if index == 0 and after_first_attention is not None:
                after_first_attention.record()
            return out

        with pdl.suspended():
            return fused_layers(model, cache, rope, state.tokens[begin:end], positions, slots,
                                attend, engine.fused, engine.matmul)  # fmt: skip

    def full():
        layers(0, rows)

    def serial():
        layers(0, half)
        layers(half, rows)

    def two_streams(offset: bool, priority: int = 0):
        side = torch.cuda.Stream(priority=priority)
        started = torch.cuda.Event()

        def run():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            layers(0, half, started if offset else None)
            with torch.cuda.stream(side):
                if offset:
                    side.wait_event(started)
                layers(half, rows)
            main.wait_stream(side)

        return run

    for fn in (full, serial):  # tune each row bucket's matmuls and attention outside capture
        fn()
    torch.cuda.synchronize()
    high = torch.cuda.Stream.priority_range()[1] if hasattr(torch.cuda.Stream, "priority_range") \
        else -1  # fmt: skip
    cases = {
        "full": full,
        "halves, serial": serial,
        "halves, 2 streams": two_streams(False),
        "halves, 2 streams, offset": two_streams(True),
        "halves, 2 streams, offset, B high priority": two_streams(True, high),
    }
    times = {}
    for _ in range(2):  # two rounds, the faster kept (machine noise)
        for name, fn in cases.items():
            t = graph_time_us(fn, calls=5)
            times[name] = min(times.get(name, t), t)
    return {"preset": preset, "rows": rows, "cached_tokens": mean_length, "us": times,
            "ratio_to_full": {k: v / times["full"] for k, v in times.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = overlap(args.preset, args.rows, args.length, args.new_tokens)
    print(f"{result['preset']}, {result['rows']} rows at {result['cached_tokens']} cached tokens"
          " (decode layers only, graph replays):")  # fmt: skip
    for name, us in result["us"].items():
        print(f"  {name:44s} {us:9.1f} us  x{result['ratio_to_full'][name]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
