"""GRPO step time, synchronous against asynchronous, on a long-tail length workload.

    python benchmarks/async_rl.py --preset qwen2.5-0.5b --prompts 128 --samples 8 \\
        --max-new-tokens 4096 --mean-new-tokens 1024 --steps 6 --prime 2 \\
        --modes sync async:1 async:1:partial async:1:partial:priority
    python benchmarks/async_rl.py ... --modes sync sync:spec async:1:partial async:1:partial:spec
    python benchmarks/async_rl.py --modes sync async:1:partial:split --prime 2 \\
        --override trainer.backend=local --override trainer.n_gpus_per_node=2  # 2 GPUs
    python benchmarks/async_rl.py --preset tiny --device cpu --prompts 4 --samples 2 \\
        --max-new-tokens 32 --mean-new-tokens 8 --steps 3          # smoke run
    python benchmarks/async_rl.py --model-dir CKPT --prompts-file rows.jsonl --prompt-len 256 \\
        --modes sync sync:spec       # a trained checkpoint (benchmarks/speculative_tail.py)

The lengths: a random-weight model samples nearly uniformly over its vocabulary, so with K of
its V ids as end-of-sequence ids (the model's config.json `eos_token_id` list) a response
ends at each token with probability ~K/V: geometric lengths of mean ~V/K, the few longest
cut at --max-new-tokens. A synchronous step waits for the longest of its samples; the
asynchronous mode (docs/async.md) trains on the last batch while the next one decodes; with
partial rollouts (async:S:partial) requests in flight continue across a weight sync, and
with :priority the rollout service decodes on a CUDA stream of its own, beside the update.

Each mode runs `hybridflow train` (one optimizer step per batch of packed --micro-tokens
micro-batches, the same in every mode: `auto` would give the async modes, which keep the KV
cache and a weight copy through the update, a smaller one) in a fresh process on the same
prompts, seed and model (jsonl prompts of --prompt-len ids spelled as the word-level
tokenizer's words; a reward hashed from the response, so groups have spread). Printed: the
mean step time of the steps after the first --warmup and before the last (an asynchronous
run's last step has nothing to overlap), the speed-up over the first mode, the realised
response lengths, each GPU's busy share over those steps (NVML's kernel-active time,
benchmarks/gpu_busy.py; "-" without a GPU), and the asynchronous metrics the run logged
(staleness, IS weights) where present.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_busy import BusySampler  # noqa: E402
from train_run import run_train, timed_run_overrides  # noqa: E402

REWARD = '''
import zlib


def hashed_score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward in [0, 1) that differs between responses (GRPO needs spread in a group)."""
    return (zlib.crc32(solution_str.encode()) % 1000) / 1000
'''


def build_model_dir(preset: str, out_dir: Path, mean_new_tokens: float) -> dict:
    """A random-weight checkpoint of the preset with ~V/mean of its ids as end-of-sequence
    ids, and beside it a word-level tokenizer (grpo_vs_trl.py) whose chat template is the
    messages' text. -> config.json's contents."""
    from grpo_model import build_hf_model_dir, load_word_tokenizer

    build_hf_model_dir(preset, str(out_dir))
    tokenizer = load_word_tokenizer(str(out_dir))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    # In a directory of its own (model.tokenizer_path): next to the model's config.json,
    # AutoTokenizer would pick the model type's tokenizer class, which cannot read it.
    tokenizer.save_pretrained(str(out_dir.parent / "tokenizer"))
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    vocab = config["vocab_size"]
    stops = max(1, round(vocab / mean_new_tokens))
    config["eos_token_id"] = list(range(vocab - 1 - stops, vocab - 1))  # not the pad id
    config_path.write_text(json.dumps(config, indent=1))
    return config


def write_prompts(path: Path, prompts: int, prompt_len: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(prompts):
            words = " ".join(f"w{rng.randrange(10, vocab // 2)}" for _ in range(prompt_len))
            row = {"data_source": "longtail", "prompt": [{"role": "user", "content": words}],
                   "reward_model": {"ground_truth": ""}}  # fmt: skip
            f.write(json.dumps(row) + "\n")


MODE_FLAGS = {
    "partial": [],  # trainer.partial_rollout, below
    "priority": ["rollout.engine.service_stream=priority"],
    "split": ["trainer.placement=split", "trainer.rollout_gpus=1"],
    "spec": ["rollout.engine.speculative=ngram"],  # verify passes of n-gram drafts in the tail
}


def mode_overrides(mode: str) -> list[str]:
    """'sync', or 'async:S' (staleness S) followed by any of ':partial' (partial rollouts),
    ':priority' (the rollout service on a high-priority CUDA stream of its own) and ':split'
    (the rollout on a device of its own, the rest training: with --override
    trainer.backend=local --override trainer.n_gpus_per_node=N, sync is colocated on all N);
    either followed by ':spec' (speculative decoding of the tail: rollout.engine.speculative)."""
    bad = (f"--modes: {mode!r} is not sync[:spec] or "
           "async:S[:partial][:priority][:split][:spec]")  # fmt: skip
    name, *rest = mode.split(":")
    if name == "sync":
        if rest not in ([], ["spec"]):
            raise SystemExit(bad)
        return ["trainer.mode=sync", *(o for flag in rest for o in MODE_FLAGS[flag])]
    staleness, *flags = rest or [""]
    if (name != "async" or not staleness.isdigit() or len(set(flags)) != len(flags)
            or not set(flags) <= set(MODE_FLAGS)):  # fmt: skip
        raise SystemExit(bad)
    return ["trainer.mode=async", f"trainer.max_staleness={staleness}",
            f"trainer.partial_rollout={'true' if 'partial' in flags else 'false'}",
            *(o for flag in flags for o in MODE_FLAGS[flag])]  # fmt: skip


def workload_paths(work: Path, args) -> dict[str, Path]:
    """The model, its tokenizer and the prompts every mode runs: --model-dir, --tokenizer-dir
    and --prompts-file where given, else the random-weight ones built under work."""
    model = Path(args.model_dir) if getattr(args, "model_dir", None) else work / "model"
    tokenizer = getattr(args, "tokenizer_dir", None) or (
        model if getattr(args, "model_dir", None) else work / "tokenizer")  # fmt: skip
    prompts = getattr(args, "prompts_file", None) or work / "prompts.jsonl"
    return {"model": model, "tokenizer": Path(tokenizer), "prompts": Path(prompts)}


def mode_run_overrides(mode: str, work: Path, args, steps: int, run_dir: Path) -> list[str]:
    """The `hybridflow train` overrides of a `steps`-step run of `mode` in run_dir."""
    paths = workload_paths(work, args)
    return [
        f"model.path={paths['model']}",
        f"model.tokenizer_path={paths['tokenizer']}",
        f"data.train_files=[{paths['prompts']}]",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len + 8}",
        f"data.max_response_length={args.max_new_tokens}",
        f"rollout.n={args.samples}",
        f"actor.ppo_mini_batch_size={args.prompts}",
        f"actor.max_tokens_per_gpu={args.micro_tokens}",
        f"reward.custom_fn={work / 'reward.py'}:hashed_score",
        *timed_run_overrides(steps, run_dir, work / "cache", args.device),
        *mode_overrides(mode),
        *args.override,
    ]


def prepare_workload(work: Path, args) -> None:
    """The random-weight model (unless --model-dir), the random-word prompts (unless
    --prompts-file) and the hashed reward, under work."""
    if args.model_dir:
        vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    else:
        vocab = build_model_dir(args.preset, work / "model", args.mean_new_tokens)["vocab_size"]
    if not args.prompts_file:
        write_prompts(work / "prompts.jsonl", args.prompts, args.prompt_len, vocab, 0)
    (work / "reward.py").write_text(REWARD)


def workload_label(args) -> str:
    """The model and lengths of the runs, for the table's title."""
    if args.model_dir:
        return f"{args.model_dir}, prompts of at most {args.prompt_len} tokens"
    return (f"{args.preset}, prompt {args.prompt_len}, responses geometric of mean "
            f"~{args.mean_new_tokens:.0f}")  # fmt: skip


def prime_caches(work: Path, args) -> None:
    """A throwaway run of --prime steps of the first mode: the compile caches it fills under
    work/cache (inductor's graphs, the engine's pinned choices) and Triton's are then warm for
    every measured mode, not for all but the first."""
    print(f"priming the compile caches: {args.prime} step(s) of {args.modes[0]}", flush=True)
    run_dir = work / "run-prime"
    overrides = mode_run_overrides(args.modes[0], work, args, args.prime, run_dir)
    run_train(overrides, "prime", run_dir, args.run_timeout)


def run_mode(mode: str, work: Path, args) -> dict | None:
    """One `hybridflow train` of `mode`: its step times and metrics; None when it failed or was
    stopped before its first step (its last log lines printed)."""
    run_dir = work / f"run-{mode.replace(':', '-')}"
    overrides = mode_run_overrides(mode, work, args, args.steps, run_dir)
    with BusySampler() as sampler:
        started = time.monotonic()
        steps, complete = run_train(overrides, mode, run_dir, args.run_timeout)
    if not steps:
        return None
    # The last step of an asynchronous run has no next batch decoding beside it: the steady
    # state is the steps between the warm-up and it (every mode alike).
    timed = steps[args.warmup : -1] or steps[args.warmup :] or steps
    before = steps.index(timed[0]) - 1  # the step that ended as the timed ones began
    window = (steps[before]["seen_at"] if before >= 0 else started, timed[-1]["seen_at"])
    for row in steps:  # the async mode's wait for its rollout lies outside train_step
        row["wall_s"] = row["timing_s/step"] + row.get("timing_s/wait_rollout", 0.0)
    mean = lambda key: sum(row.get(key, 0.0) for row in timed) / len(timed)  # noqa: E731
    logged = ("async/", "staleness/", "rollout/speculative_", "rollout/tail_")
    extra = sorted({k for row in timed for k in row if k.startswith(logged)})
    return {
        "mode": mode,
        "complete": complete,
        "step_s": mean("wall_s"),
        "gen_s": mean("timing_s/gen"),  # asynchronous: timed on the producer, beside the update
        "steps_s": [row["wall_s"] for row in steps],
        "timed_s": [row["wall_s"] for row in timed],
        "response_mean": mean("response_length/mean"),
        "response_max": max(row.get("response_length/max", 0.0) for row in timed),
        "clip_ratio": mean("response_length/clip_ratio"),
        "async_metrics": {k: mean(k) for k in extra},
        "gpu_busy": sampler.busy(*window),  # % per GPU over the timed steps; None: no NVML
    }


UNEVEN = 1.5
"""Timed steps further apart than this ratio (slowest / fastest) are no steady state."""


def uneven_warning(mode: str, timed: list[float]) -> str | None:
    """A warning when ``mode``'s timed steps differ by more than UNEVEN: one of them compiled
    or stalled, and a mean over it says nothing of the steady state (a one-step prime warms
    only the first step's graphs; the second may compile again)."""
    if len(timed) < 2 or min(timed) <= 0 or max(timed) / min(timed) <= UNEVEN:
        return None
    return (f"warning: {mode}'s timed steps differ {max(timed) / min(timed):.1f}× "
            f"({min(timed):.2f} .. {max(timed):.2f} s): one compiled or stalled, so its mean "
            f"is no steady state; warm more (--prime 2, --warmup) or read the steps")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--mean-new-tokens", type=float, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-tokens", default="32768", help="actor.max_tokens_per_gpu, every mode")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the mean")
    p.add_argument("--prime", type=int, default=0, metavar="STEPS",
                   help="steps of a throwaway run of the first mode before the measured ones, "
                        "so every mode finds the compile caches warm (cold, the first step of "
                        "the default workload took ~190 s on an H200, the second ~50)")  # fmt: skip
    p.add_argument("--modes", nargs="+", default=["sync", "async:1", "async:1:partial"])
    p.add_argument("--device", default=None, help="trainer.device (cpu: a smoke run)")
    p.add_argument("--override", action="append", default=[], help="a config override, every mode")
    p.add_argument("--work-dir", default=None, help="model, prompts and runs (default: a temp dir)")
    p.add_argument("--run-timeout", type=float, default=3000)
    p.add_argument("--model-dir", default=None,
                   help="a trained checkpoint (config.json and weights) instead of a random-"
                        "weight --preset: its own end-of-sequence ids end the responses, so "
                        "--mean-new-tokens is unused (benchmarks/speculative_tail.py)")  # fmt: skip
    p.add_argument("--tokenizer-dir", default=None, help="--model-dir's tokenizer (default: it)")
    p.add_argument("--prompts-file", default=None,
                   help="prompt rows (jsonl or parquet, the data schema) instead of random "
                        "words; --prompt-len must cover their tokens")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args()
    for mode in args.modes:
        mode_overrides(mode)  # a bad mode stops here, before anything is built
    for flag, path in (("--model-dir", args.model_dir), ("--tokenizer-dir", args.tokenizer_dir),
                       ("--prompts-file", args.prompts_file)):  # fmt: skip
        if path is not None and not Path(path).exists():
            raise SystemExit(f"{flag} {path}: no such file or directory")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
    prepare_workload(work, args)
    if args.prime:
        prime_caches(work, args)
    results = []
    for mode in args.modes:  # each printed as it ends: a run cut short keeps what it measured
        result = run_mode(mode, work, args)
        if result is None:
            continue
        results.append(result)
        print(
            f"{mode}: {results[-1]['step_s']:.2f} s/step, steps (s) "
            + " ".join(f"{s:.2f}" for s in results[-1]["steps_s"]),
            flush=True,
        )
    if not results:
        raise SystemExit("no mode finished a step: nothing to compare")
    print(f"\nGRPO, {workload_label(args)}, {args.prompts} prompts × {args.samples} samples, "
          f"up to {args.max_new_tokens} new tokens; mean of steps {args.warmup + 1}.."
          f"{args.steps - 1}")  # fmt: skip
    print("| mode | s/step | speed-up | response mean | response max | cut at max "
          "| GPU busy % | steps (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        steps = " ".join(f"{s:.2f}" for s in r["steps_s"])
        name = r["mode"] if r["complete"] else f"{r['mode']} (stopped at --run-timeout)"
        busy = " / ".join(f"{b:.0f}" for b in r["gpu_busy"]) if r["gpu_busy"] else "-"
        print(f"| {name} | {r['step_s']:.2f} | {results[0]['step_s'] / r['step_s']:.2f}× | "
              f"{r['response_mean']:.0f} | {r['response_max']:.0f} | {100 * r['clip_ratio']:.1f}% "
              f"| {busy} | {steps} |")  # fmt: skip
    for r in results:
        warning = uneven_warning(r["mode"], r["timed_s"])
        if warning:
            print(warning)
    for r in results:
        if r["async_metrics"]:
            shown = ", ".join(f"{k}={v:.3g}" for k, v in r["async_metrics"].items())
            print(f"{r['mode']}: {shown}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
