"""Two engine settings in one process, their generate() calls interleaved: an A/B that
resolves differences of ~1%.

Why: separate processes on one machine spread ~1.5-2% on a whole call (session 10: 1.5b/256
at 78.1k and 76.9k tok/s with identical code), which hid every change of that size
(engine/NOTES.md run 14). Here both engines share the model and the process, each keeps its
own graphs, tuned tiles and decode-path decisions, and the timed calls alternate A B B A A B
... so drift (clocks, host noise) falls on both sides.

A setting is NAME=VALUE: `module.ATTR` (a hybridflow.engine module's global, applied while
that side's engine is built and warmed up, and around each of its calls: read at graph
capture or at each call, either way it is in force) or an Engine keyword. VALUE is a Python
literal, else a string.

    python benchmarks/engine_ab.py --preset qwen2.5-1.5b --prompts 256 \\
        --a lean.MODE=off --b lean.MODE=auto --rounds 6
    python benchmarks/engine_ab.py --preset tiny --prompts 8 --new-tokens 16 --device cpu \\
        --a loop.SYNC_LAG=0 --b loop.SYNC_LAG=1 --rounds 2   # dry run
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import statistics
import time

import torch

from hybridflow.engine import Engine, SamplingParams
from hybridflow.engine.bench_cli import make_prompts
from hybridflow.models import load_model


def parse_settings(pairs: list[str]) -> tuple[dict, dict]:
    """["lean.MODE=off", "steps_per_sync=16"] -> ({("lean", "MODE"): "off"},
    {"steps_per_sync": 16}): module globals and Engine keywords."""
    globals_, kwargs = {}, {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"setting {pair!r}: expected NAME=VALUE")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        if "." in name:
            module, attr = name.rsplit(".", 1)
            target = importlib.import_module(f"hybridflow.engine.{module}")
            if not hasattr(target, attr):
                raise ValueError(f"setting {pair!r}: hybridflow.engine.{module} has no {attr}")
            globals_[(module, attr)] = value
        else:
            kwargs[name] = value
    return globals_, kwargs


@contextlib.contextmanager
def applied(globals_: dict):
    """The module globals set inside, restored after."""
    saved = {}
    try:
        for (module, attr), value in globals_.items():
            target = importlib.import_module(f"hybridflow.engine.{module}")
            saved[(target, attr)] = getattr(target, attr)
            setattr(target, attr, value)
        yield
    finally:
        for (target, attr), value in saved.items():
            setattr(target, attr, value)


TUNED_MODULES = ("attention_kernels", "kernels", "gemm", "gemm_persistent", "sampler_kernels",
                 "chain", "lean")  # fmt: skip


def clear_tuners() -> int:
    """Empty every triton.autotune cache in the engine's kernel modules, so the next engine
    built tunes its own tiles (they are process-wide: without this side B would reuse the
    tiles side A's warm-up chose, and a setting that changes where tuning happens could not
    be compared). Graphs already captured keep the kernels they launched. Returns how many."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return 0
    cleared = 0
    for name in TUNED_MODULES:
        module = importlib.import_module(f"hybridflow.engine.{name}")
        for value in vars(module).values():
            if isinstance(value, Autotuner):
                value.cache.clear()
                cleared += 1
    return cleared


def attention_tiles() -> dict:
    from hybridflow.engine.bench_cli import _attention_tiles

    return _attention_tiles()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ab(args, sides: dict[str, list[str]]) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    model = load_model(args.preset, dtype=dtype, device=device).eval()
    prompts = make_prompts(args.prompts, args.prompt_len, model.config.vocab_size, 0)
    params = SamplingParams(n=getattr(args, "n", 1), max_new_tokens=args.new_tokens, seed=0,
                            ignore_eos=True)  # fmt: skip
    engines, settings, tiles = {}, {}, {}
    for side, pairs in sides.items():
        settings[side] = parse_settings(pairs)
        if getattr(args, "retune", False):
            clear_tuners()
        with applied(settings[side][0]):
            kwargs = {"max_batch_size": args.prompts * getattr(args, "n", 1),
                      "max_seq_len": args.prompt_len + args.new_tokens, **settings[side][1]}  # fmt: skip
            engines[side] = Engine(model, **kwargs)
            engines[side].generate(prompts, params)  # warm-up: compile, tune, capture
            sync(device)
        tiles[side] = attention_tiles()
    runs: dict[str, list[float]] = {side: [] for side in sides}
    tokens_of: dict[str, list] = {}
    order = list(sides)
    for round_index in range(args.rounds):
        for side in order if round_index % 2 == 0 else order[::-1]:  # A B, B A, A B, ...
            with applied(settings[side][0]):
                sync(device)
                start = time.perf_counter()
                out = engines[side].generate(prompts, params)
                sync(device)
                runs[side].append(time.perf_counter() - start)
                tokens_of[side] = [c.token_ids for c in out]
    tokens = args.prompts * getattr(args, "n", 1) * args.new_tokens
    a, b = order
    ratios = [tb / ta for ta, tb in zip(runs[a], runs[b])]
    result = {
        "preset": args.preset, "prompts": args.prompts, "n": getattr(args, "n", 1),
        "new_tokens": args.new_tokens,
        "device": str(device), "sides": sides,
        "runs_s": {side: [round(t, 4) for t in ts] for side, ts in runs.items()},
        "tokens_per_s": {side: tokens / statistics.median(ts) for side, ts in runs.items()},
        "b_over_a_time": {"median": statistics.median(ratios), "all": [round(r, 4) for r in ratios]},
        "b_faster_rounds": sum(r < 1 for r in ratios),
        "decisions": {side: {str(k): v for k, v in e.chain.decisions.items()} if e.chain else {}
                      for side, e in engines.items()},
        "attention_tiles": tiles,
        # same seeds on both sides: a setting that keeps the arithmetic gives the same
        # completions. One that changes any rounding flips nearly all of them: a random-weight
        # model's next-token distribution is almost flat over its ~152k ids at temperature 1
        # (session 12: 0 of 512 for every such A/B), so this tells bitwise-equal settings apart
        # and nothing more
        "same_completions": sum(x == y for x, y in zip(tokens_of[a], tokens_of[b])),
        "completions": len(tokens_of[a]),
    }  # fmt: skip
    for engine in engines.values():
        engine.release()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--a", nargs="*", default=[], help="side A's settings (NAME=VALUE)")
    parser.add_argument("--b", nargs="*", default=[], help="side B's settings (NAME=VALUE)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--retune", action="store_true",
                        help="empty the Triton autotuners' caches before each side's warm-up "
                        "(else B reuses A's tiles)")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run_ab(args, {"A": args.a, "B": args.b})
    print(f"{result['preset']}, {result['prompts']} prompts x {result['n']} samples x "
          f"{result['new_tokens']} tokens, "
          f"{result['device']}")  # fmt: skip
    print("| side | settings | tok/s (median) | runs (s) | decode paths |\n|---|---|---|---|---|")
    for side in ("A", "B"):
        print(f"| {side} | {' '.join(result['sides'][side]) or '(defaults)'} | "
              f"{result['tokens_per_s'][side]:,.0f} | {result['runs_s'][side]} | "
              f"{result['decisions'][side]} |")  # fmt: skip
    for side in ("A", "B"):
        for key, tile in result["attention_tiles"][side].items():
            head = ", ".join(k for k in key.strip("()").split(", ") if "torch." not in k)
            print(f"attention tile {side}: {tile} (key {head})")
    print(f"identical completions A vs B (last round): {result['same_completions']} of "
          f"{result['completions']}")  # fmt: skip
    ratio = result["b_over_a_time"]
    print(f"B / A time per round: median {ratio['median']:.4f}, all {ratio['all']}; "
          f"B faster in {result['b_faster_rounds']} of {len(ratio['all'])} rounds")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
