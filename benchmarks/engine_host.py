"""Where the host's time goes in one warm generate() call: cProfile of the whole call, the
functions with the most own time, and the per-admission host cost of each step of _admit
(prefill forward, sampling, bookkeeping). Host time matters where the GPU waits for it: the
eager prefill passes launch every kernel from Python (engine_timeline.py finds the GPU idle
during admissions on slow hosts).

    python benchmarks/engine_host.py --preset qwen2.5-0.5b --rows 1024      # H200, ~1 min
    python benchmarks/engine_host.py --device cpu --preset tiny --rows 8 --new-tokens 8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from hybridflow.engine import Engine, SamplingParams
from hybridflow.engine.bench_cli import make_prompts
from hybridflow.models import load_model


@torch.no_grad()
def host_profile(preset: str, rows: int, length: int, new_tokens: int, device: torch.device,
                 top: int) -> str:  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(preset, dtype=dtype, device=device).eval()
    eng = Engine(model, max_batch_size=rows, max_seq_len=length + new_tokens + 64)
    prompts = make_prompts(rows, length, model.config.vocab_size, 0)
    params = SamplingParams(max_new_tokens=new_tokens, seed=0, ignore_eos=True)
    for _ in range(2):  # compile, tune, capture; then a warm call
        eng.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    eng.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main() -> None:
    from engine_step import add_case_arguments  # benchmarks/ is the script's own folder

    parser = argparse.ArgumentParser()
    add_case_arguments(parser)
    parser.add_argument("--top", type=int, default=40, help="functions listed per ordering")
    args = parser.parse_args()
    print(host_profile(args.preset, args.rows, args.length, args.new_tokens,
                       torch.device(args.device), args.top))  # fmt: skip


if __name__ == "__main__":
    main()
