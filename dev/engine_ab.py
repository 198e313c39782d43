"""Two engines in one process, their generate() calls interleaved: an A/B that resolves
differences of ~1%, between engine options or between two versions of the code.

Why: separate processes on one H200 spread ~1.5-2% on a whole call (1.5b/256 at 78.1k and
76.9k tok/s with identical code), which hides every change of that size. Here both engines
live in one process, each with its own graphs, tuned tiles and decode-layer decisions, and
the timed calls alternate A B B A A B ... so drift (clocks, host noise) falls on both sides.

A side is EngineOptions fields (NAME=VALUE, VALUE a Python literal, else a string) and, with
--a-tree/--b-tree, another checkout's `hybridflow` package (e.g. the main branch before a
change: `git worktree add /tmp/before main`), imported under its own name so both versions
run side by side; each side builds its model from its own package (same preset, same seed:
the same weights). A side from another tree takes that version's default options.

    python dev/engine_ab.py --preset qwen2.5-1.5b --prompts 256 \\
        --a decode_layer=split --b decode_layer=auto --rounds 6
    python dev/engine_ab.py --preset qwen2.5-0.5b --prompts 256 --a-tree /tmp/before --rounds 8
    python dev/engine_ab.py --preset tiny --prompts 8 --new-tokens 16 --device cpu \\
        --a sync_lag=0 --b sync_lag=1 --rounds 2   # dry run
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_settings(pairs: list[str]) -> dict:
    """["decode_layer=split", "steps_per_sync=16"] -> EngineOptions fields (checked)."""
    from hybridflow.bench.common import parse_engine_settings
    from hybridflow.engine.options import EngineOptions

    values = parse_engine_settings(pairs)
    EngineOptions.from_dict(values).checked()  # a bad name or value fails before any model
    return values


def import_tree(tree: str | Path, alias: str) -> str:
    """Copy `tree`/hybridflow to a temporary folder as package `alias`, its absolute imports
    rewritten, and put it on sys.path. Returns the alias."""
    source = Path(tree) / "hybridflow"
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"{tree}: no hybridflow package there (a checkout's root is expected)")
    root = Path(tempfile.mkdtemp(prefix="engine-ab-"))
    shutil.copytree(source, root / alias, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (root / alias).rglob("*.py"):
        text = path.read_text()
        text = text.replace("from hybridflow.", f"from {alias}.").replace(
            "from hybridflow import", f"from {alias} import"
        )
        text = text.replace("import hybridflow.", f"import {alias}.")
        text = text.replace('"hybridflow.', f'"{alias}.')  # lazy imports by module name
        path.write_text(text)
    sys.path.insert(0, str(root))
    return alias


def build_side(package: str, options: dict, args, device, dtype):
    """(engine, prompts, params) of one side, from `package` (hybridflow or an alias)."""
    engine_pkg = importlib.import_module(f"{package}.engine")
    models = importlib.import_module(f"{package}.models")
    from hybridflow.bench.common import make_prompts  # both sides' prompts: the same ids

    model = models.load_model(args.preset, dtype=dtype, device=device).eval()
    prompts = make_prompts(args.prompts, args.prompt_len, model.config.vocab_size, 0)
    params = engine_pkg.SamplingParams(n=args.n, max_new_tokens=args.new_tokens, seed=0,
                                       ignore_eos=True)  # fmt: skip
    sizes = {"max_batch_size": args.prompts * args.n,
             "max_seq_len": args.prompt_len + args.new_tokens}  # fmt: skip
    if hasattr(engine_pkg, "EngineOptions"):
        engine = engine_pkg.Engine(model, **sizes, options=engine_pkg.EngineOptions(**options))
    else:  # a version from before EngineOptions: its defaults
        if options:
            raise SystemExit(f"{package}: this version takes no options ({options})")
        engine = engine_pkg.Engine(model, **sizes)
    return engine, prompts, params


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ab(args, sides: dict[str, dict]) -> dict:
    """sides: name -> {"package": str, "options": dict}."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    built = {}
    for side, spec in sides.items():
        engine, prompts, params = build_side(spec["package"], spec["options"], args, device, dtype)
        start = time.perf_counter()
        engine.generate(prompts, params)  # warm-up: compile, tune, capture
        sync(device)
        built[side] = (engine, prompts, params, time.perf_counter() - start)
    runs: dict[str, list[float]] = {side: [] for side in sides}
    tokens_of: dict[str, list] = {}
    order = list(sides)
    for round_index in range(args.rounds):
        for side in order if round_index % 2 == 0 else order[::-1]:  # A B, B A, A B, ...
            engine, prompts, params, _ = built[side]
            sync(device)
            start = time.perf_counter()
            out = engine.generate(prompts, params)
            sync(device)
            runs[side].append(time.perf_counter() - start)
            tokens_of[side] = [c.token_ids for c in out]
    tokens = args.prompts * args.n * args.new_tokens
    a, b = order
    ratios = [tb / ta for ta, tb in zip(runs[a], runs[b])]
    result = {
        "preset": args.preset, "prompts": args.prompts, "n": args.n,
        "new_tokens": args.new_tokens, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "sides": sides,
        "warmup_s": {side: round(entry[3], 2) for side, entry in built.items()},
        "runs_s": {side: [round(t, 4) for t in ts] for side, ts in runs.items()},
        "tokens_per_s": {side: tokens / statistics.median(ts) for side, ts in runs.items()},
        "b_over_a_time": {"median": statistics.median(ratios), "all": [round(r, 4) for r in ratios]},
        "b_faster_rounds": sum(r < 1 for r in ratios),
        # same seeds on both sides: settings that keep the arithmetic give the same
        # completions; one that changes any rounding flips nearly all of them (a random-weight
        # model's next-token distribution is almost flat over its ~152k ids at temperature 1),
        # so this tells bitwise-equal settings apart and nothing more
        "same_completions": sum(x == y for x, y in zip(tokens_of[a], tokens_of[b])),
        "completions": len(tokens_of[a]),
    }  # fmt: skip
    result["decode_layers"] = {side: decode_layers(entry[0]) for side, entry in built.items()}
    for engine, *_ in built.values():
        engine.release()
    return result


def decode_layers(engine) -> dict:
    """The decode layer each batch bucket ran (this version's chooser, or an older one's)."""
    chooser = getattr(engine, "chooser", None) or getattr(engine, "chain", None)
    return {str(k): v for k, v in getattr(chooser, "decisions", {}).items()}


def print_result(result: dict) -> None:
    print(f"{result['preset']}, {result['prompts']} prompts x {result['n']} samples x "
          f"{result['new_tokens']} tokens, {result['gpu']}, torch {result['torch']}")  # fmt: skip
    print("| side | code | options | tok/s (median) | runs (s) |\n|---|---|---|---|---|")
    for side, spec in result["sides"].items():
        options = " ".join(f"{k}={v}" for k, v in spec["options"].items()) or "(defaults)"
        print(f"| {side} | {spec['label']} | {options} | {result['tokens_per_s'][side]:,.0f} | "
              f"{result['runs_s'][side]} |")  # fmt: skip
    print(f"decode layers: {result['decode_layers']}")
    print(f"identical completions A vs B (last round): {result['same_completions']} of "
          f"{result['completions']}")  # fmt: skip
    ratio = result["b_over_a_time"]
    print(f"B / A time per round: median {ratio['median']:.4f}, all {ratio['all']}; "
          f"B faster in {result['b_faster_rounds']} of {len(ratio['all'])} rounds")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for side in ("a", "b"):
        parser.add_argument(f"--{side}", nargs="*", default=[],
                            help=f"side {side.upper()}'s EngineOptions (NAME=VALUE)")  # fmt: skip
        parser.add_argument(f"--{side}-tree", default=None,
                            help=f"side {side.upper()} runs this checkout's hybridflow")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sides = {}
    for side in ("a", "b"):
        tree = getattr(args, f"{side}_tree")
        package = import_tree(tree, f"hybridflow_{side}") if tree else "hybridflow"
        options = parse_settings(getattr(args, side)) if not tree else {}
        if tree and getattr(args, side):
            raise SystemExit(f"--{side}-tree runs that version's defaults; drop --{side}")
        sides[side.upper()] = {"package": package, "options": options,
                               "label": str(tree) if tree else "this checkout"}  # fmt: skip
    result = run_ab(args, sides)
    print_result(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
