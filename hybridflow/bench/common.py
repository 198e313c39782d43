"""What every engine ``hybridflow bench`` command shares: the --engine fields as EngineOptions,
random prompts, a device sync around timed calls, the phases reported on stderr, and the run
of a command (check, bench, print, --json)."""

from __future__ import annotations

import ast
import json
import sys

WARM_UP = "engine warm-up (compile, tune, capture graphs)"
_YAML_WORDS = {"true": True, "false": False, "null": None}  # as rollout.engine.* is written


def parse_engine_settings(pairs: list[str]) -> dict:
    """["decode_layer=split", "steps_per_sync=16"] -> {"decode_layer": "split", ...}: VALUE
    is a Python literal (16, None, True) or the config's true/false/null, else a string."""
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--engine {pair!r}: expected NAME=VALUE")
        if text in _YAML_WORDS:
            out[name] = _YAML_WORDS[text]
            continue
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[name] = text
    return out


def engine_options(args):
    """The EngineOptions of a `bench rollout` command line (ValueError naming a bad field)."""
    from hybridflow.engine.options import EngineOptions

    values = parse_engine_settings(getattr(args, "engine", []) or [])
    values.setdefault("decode_backend", getattr(args, "backend", "auto"))
    if getattr(args, "no_graphs", False):
        values.setdefault("cuda_graphs", False)
    if getattr(args, "cache_dir", None):
        values.setdefault("cache_dir", args.cache_dir)
    if getattr(args, "retune", False):
        values.setdefault("retune", True)
    return EngineOptions.from_dict(values).checked()


def run_bench_command(name: str, args, bench, show, engine_args=None) -> int:
    """Check the --engine fields, run ``bench(args)``, print its table with ``show`` and
    write its result to --json: the shape of every engine ``hybridflow bench`` command."""
    try:
        engine_options(args if engine_args is None else engine_args)
    except ValueError as error:  # a bad --engine field: say which, no traceback
        print(f"hybridflow bench {name}: {error}", file=sys.stderr)
        return 2
    progress = bench_reporter()
    try:
        result = bench(args, progress=progress)
    finally:
        progress.close()
    show(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def bench_reporter():
    """The phases of a bench command (loading, warm-up, timed runs) on stderr, beside the
    table on stdout: a status line after 30 s of silence (a cold warm-up compiles and tunes
    kernels for minutes). No live bar, on a terminal either: it would redraw from a thread
    while host-bound engine loops are being timed."""
    from rich.console import Console

    from hybridflow.progress import ProgressReporter

    return ProgressReporter(Console(stderr=True), live=False, interval_s=30)


def counted(task, call):
    """``call`` that advances ``task`` by one each time it returns."""

    def run():
        result = call()
        task.advance()
        return result

    return run


def sync_device(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # Skip the lowest ids (specials in the char tokenizer) so no prompt holds an EOS.
    return torch.randint(16, vocab, (num, length), generator=g).tolist()


def load_bench_model(args, progress):
    """(model, device) for a bench command's --preset, --device (default: CUDA when there is
    one) and --dtype (on CUDA; the CPU computes in fp32), loaded under a progress task."""
    import torch

    from hybridflow.models import load_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    with progress.task(f"loading {args.preset}"):
        model = load_model(args.preset, dtype=dtype, device=device).eval()
    return model, device
