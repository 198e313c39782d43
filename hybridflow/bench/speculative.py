"""`hybridflow bench rollout --speculative ngram`: the engine with speculative decoding off and
on, same prompts, same seeds, so the same tokens (speculative sampling keeps them), in one
process: tok/s, verify passes (their count over the timed calls, their seconds per call),
the share of drafts accepted and the tokens a row emits per pass.

    hybridflow bench rollout --preset qwen2.5-0.5b --prompts 256 --new-tokens 1024 \\
        --mean-length 256 --speculative ngram --repeats 3 --no-hf
    hybridflow bench rollout --preset /path/to/sft-checkpoint ... --speculative ngram
    hybridflow bench rollout --preset /path/to/7b ... --speculative draft \\
        --engine speculative_draft_model=/path/to/0.5b

Each timed call samples with a seed of its own (the warm-up another): the draft store then
holds earlier calls' samples of the same prompts, as a training run's earlier epochs, never
the very samples being drawn. Random weights repeat nothing and accept (almost) nothing:
measure a checkpoint trained to write the task's text. --mean-length gives the long tail
(sample lengths ~geometric) where speculation runs (EngineOptions.speculative_max_rows).
"""

from __future__ import annotations

import argparse


def with_speculation(args, method: str) -> argparse.Namespace:
    """A copy of `args` whose engine runs with speculative=method (other --engine fields
    kept; a speculative= field given there is replaced, and graph_verify_steps, which
    needs speculation, is dropped for method "off")."""
    dropped = ("speculative=", *(("graph_verify_steps=",) if method == "off" else ()))
    kept = [pair for pair in args.engine if not pair.startswith(dropped)]
    return argparse.Namespace(**{**vars(args), "engine": [*kept, f"speculative={method}"]})


def bench_speculative(bench_engine, model, prompts, args, device, progress=None) -> dict:
    """``bench_engine`` (bench/rollout.py's, passed in) with speculation off, then on
    (args.speculative: the method)."""
    off = bench_engine(model, prompts, with_speculation(args, "off"), device, progress)
    on = bench_engine(model, prompts, with_speculation(args, args.speculative), device, progress)
    return {"method": args.speculative, "off": off, "on": on,
            "speedup": on["tokens_per_s"] / off["tokens_per_s"],
            "same_tokens": off["token_digest"] == on["token_digest"]}  # fmt: skip


def print_speculative(result: dict) -> None:
    spec = result["speculative"]
    print(f"  speculative decoding ({spec['method']}), same prompts and seeds:")
    print(f"    {'method':<8} {'tok/s':>12} {'seconds':>9} {'passes':>8} {'in passes':>10} "
          f"{'accepted':>9} {'tok/pass':>9}")  # fmt: skip
    for name in ("off", "on"):
        run = spec[name]
        metrics = run.get("speculative") or {}
        label = "off" if name == "off" else spec["method"]
        passes = metrics.get("rollout/speculative_passes", 0.0)
        accepted = metrics.get("rollout/speculative_acceptance_rate", 0.0)
        per_pass = metrics.get("rollout/speculative_tokens_per_pass", 1.0) if passes else 1.0
        in_passes = metrics.get("rollout/speculative_seconds", 0.0) / max(run["repeats"], 1)
        print(f"    {label:<8} {run['tokens_per_s']:>12,.0f} {run['seconds']:>9.3f} "
              f"{passes:>8.0f} {in_passes:>9.3f}s {accepted:>9.1%} {per_pass:>9.2f}")  # fmt: skip
    # a draft model keeps the distribution, not the tokens of a seed (greedy aside)
    why = "a draft model: the same distribution" if spec["method"] == "draft" else "float rounding"
    same = "the same tokens" if spec["same_tokens"] else f"DIFFERENT tokens ({why})"
    print(f"    speedup {spec['speedup']:.2f}x; {same}")
