"""Does splitting a decode batch over two CUDA streams (two independent half-batches in one
graph) hide the per-kernel latency of a small-batch decode step? Times the engine's own
decode forward (the fused Triton path, lm_head included, sampler excluded) as graph replays:
one stream over all rows vs k streams over rows/k each.

    PYTHONPATH=. python benchmarks/engine_overlap.py --out $OUT   # H200, ~1 min

Timed with gemm.graph_time_us (median replay). The session-3 results (NOTES.md run 7) came
from this script's own timer before it was folded into that one: the mean of 20 replays.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hybridflow.engine import Engine, SamplingParams
from hybridflow.engine.bench_cli import make_prompts
from hybridflow.engine.gemm import graph_time_us
from hybridflow.models import load_model


@torch.no_grad()
def measure(preset: str, rows: int, length: int, ways: list[int]) -> dict:
    device = torch.device("cuda")
    model = load_model(preset, dtype=torch.bfloat16, device=device).eval()
    engine = Engine(model, max_batch_size=rows, max_seq_len=length + 64)
    engine.generate(make_prompts(rows, 16, model.config.vocab_size, 0),
                    SamplingParams(max_new_tokens=4, seed=0, ignore_eos=True))  # fmt: skip
    runner = engine.runner
    forward = runner.decode_forward
    tokens = torch.randint(0, model.config.vocab_size, (rows,), device=device)
    positions = torch.full((rows,), length, dtype=torch.int64, device=device)
    slots = torch.arange(rows, device=device)
    max_len = engine.cache.max_seq_len
    out = {"preset": preset, "rows": rows, "length": length}
    for k in ways:
        streams = [torch.cuda.Stream() for _ in range(k)]
        size = rows // k

        def capture(streams=streams, size=size):
            here = torch.cuda.current_stream()
            for i, s in enumerate(streams):
                s.wait_stream(here)
                with torch.cuda.stream(s):
                    part = slice(i * size, (i + 1) * size)
                    forward(model, engine.cache, engine.rope, tokens[part], positions[part],
                            slots[part], max_len)  # fmt: skip
            for s in streams:
                here.wait_stream(s)

        out[f"{k}_streams_us"] = round(graph_time_us(capture, calls=1, replays=20), 1)
        print(json.dumps(out), flush=True)
    # one stream over half the rows: what a half costs alone
    half = slice(0, rows // 2)
    out["half_rows_1_stream_us"] = round(graph_time_us(lambda: forward(
        model, engine.cache, engine.rope, tokens[half], positions[half], slots[half], max_len
    ), calls=1, replays=20), 1)  # fmt: skip
    print(json.dumps(out), flush=True)
    engine.release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/overlap"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = [
        measure("qwen2.5-0.5b", 256, 256, [1, 2, 4]),
        measure("qwen2.5-0.5b", 1024, 256, [1, 2]),
        measure("qwen2.5-1.5b", 256, 256, [1, 2]),
    ]
    with open(os.path.join(args.out, "overlap.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
