"""The two GPU phases of benchmarks/speculative_tail.py, each run in a process of its own (its
memory freed at its end, a crash or a time limit costing only its own result):

    python benchmarks/speculative_phases.py sft WORK --seconds S [...]
    python benchmarks/speculative_phases.py generation WORK --model-dir DIR [...]

sft: a fresh model of --preset, its vocabulary the tokenizer's (WORK/tokenizer), trained on
WORK/sft.jsonl for --seconds of optimizer steps (the project's run_sft, stopped at the time),
saved with its tokenizer to WORK/sft/hf; WORK/sft.json says how it went.

generation: the engine on WORK/gen_prompts.json (chat-templated GSM8K questions), n samples a
prompt at the run's temperature, the model's own end of sequence ending them: with
speculation off, then on (one engine each, one after the other), a warm-up call then timed
calls, each with a seed of its own and the same seeds in both (speculative sampling keeps
the tokens, so both decode the same workload). Each call: its seconds, the long tail's
(scheduling/tail.py), the tokens and lengths, and with speculation the acceptance rate, the
tokens a row emits per verify pass and the tail seconds saved by the engine's own estimate.
WORK/generation.json holds every call so far after each call.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path


def write_json(path: Path, data) -> None:
    """Written whole or not at all: a process killed mid-write leaves the last version."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps(data, indent=1))
    part.replace(path)


def resolve_device(name: str | None):
    import torch

    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device("cuda:0" if name == "cuda" else name)


# -- sft ----------------------------------------------------------------------------------------


def sft_phase(args) -> None:
    import torch

    from hybridflow.config import SFTConfig
    from hybridflow.models import build_model, load_tokenizer
    from hybridflow.models.presets import preset_config
    from hybridflow.trainer.loop.sft_loop import load_sft_examples, run_sft, save_hf_model

    work = Path(args.work)
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(str(work / "tokenizer"))
    cfg = SFTConfig(train_files=[str(work / "sft.jsonl")], total_steps=args.max_steps,
                    batch_size=args.batch, lr=args.lr, warmup_steps=args.warmup_steps,
                    lr_decay_steps=args.decay_steps, min_lr_ratio=0.1, weight_decay=0.1,
                    max_length=args.max_length, max_tokens_per_gpu=args.micro_tokens,
                    stop_at_accuracy=None)  # fmt: skip
    examples, dropped = load_sft_examples(cfg.train_files, tokenizer, cfg, val_size=0)
    tokens_per_example = sum(len(e.input_ids) for e in examples) / max(len(examples), 1)
    print(f"sft: {len(examples)} examples of {tokens_per_example:.0f} tokens on average "
          f"({dropped} over {args.max_length} dropped)", flush=True)  # fmt: skip
    config = dataclasses.replace(preset_config(args.preset), vocab_size=len(tokenizer),
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model = build_model(config, dtype=torch.float32, device=device)
    losses: list[float] = []
    started = time.monotonic()
    deadline = started + args.seconds

    def log(metrics: dict[str, float], step: int) -> None:
        losses.append(metrics["sft/loss"])
        if step == 1 or step % args.log_every == 0:
            print(f"  sft step {step}: loss {metrics['sft/loss']:.3f} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip

    trainer = run_sft(model, examples, cfg, device=str(device), seed=0,
                      pad_token_id=tokenizer.pad_token_id or 0, log=log,
                      should_stop=lambda trainer, step: time.monotonic() > deadline)  # fmt: skip
    seconds = time.monotonic() - started
    save_hf_model(trainer.model, tokenizer, work / "sft" / "hf")
    last = losses[-10:]
    result = {"steps": trainer.steps_done, "seconds": seconds, "examples": len(examples),
              "batch": cfg.batch_size, "lr": cfg.lr, "first_loss": losses[0] if losses else None,
              "final_loss": sum(last) / len(last) if last else None,
              "epochs": trainer.steps_done * cfg.batch_size / max(len(examples), 1),
              "tokens_per_s": trainer.steps_done * cfg.batch_size * tokens_per_example
              / max(seconds, 1e-9), "model_dir": str(work / "sft" / "hf")}  # fmt: skip
    write_json(work / "sft.json", result)
    print(f"sft: {result['steps']} steps in {seconds:.0f} s ({result['epochs']:.2f} epochs), "
          f"loss {result['first_loss']:.3f} -> {result['final_loss']:.3f}; saved "
          f"{result['model_dir']}", flush=True)  # fmt: skip


# -- generation ---------------------------------------------------------------------------------


def call_record(engine, prompts, params, device) -> tuple[dict, list]:
    """One timed generate(): its seconds, tail and lengths (and speculation's metrics)."""
    import torch

    from hybridflow.engine.scheduling.tail import tail_metrics

    speculation = engine.speculation
    tail_before = dataclasses.replace(engine.tail)
    spec_before = dataclasses.replace(speculation.stats) if speculation is not None else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    completions = engine.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    lengths = [len(c.token_ids) for c in completions]
    tail = engine.tail.since(tail_before)
    pair = None
    record = {"seed": params.seed, "seconds": seconds, "tail_s": tail.seconds,
              "tail_steps": tail.steps, "tokens": sum(lengths),
              "tokens_per_s": sum(lengths) / seconds, "response_mean": sum(lengths) / len(lengths),
              "response_max": max(lengths),
              "cut": sum(c.finish_reason == "length" for c in completions),
              "digests": [hashlib.sha1(repr(c.token_ids).encode()).hexdigest()[:12]
                          for c in completions]}  # fmt: skip
    if spec_before is not None:
        call = speculation.stats.since(spec_before)
        record.update(call.metrics())
        pair = (call, speculation.stats)
    record.update(tail_metrics(tail, engine.tail, pair))
    return record, completions


def show_call(method: str, label: str, r: dict) -> None:
    spec = ""
    if "rollout/speculative_passes" in r:
        saved = r.get("rollout/speculative_tail_seconds_saved")
        spec = (f", {r['rollout/speculative_passes']:.0f} passes, accepted "
                f"{r['rollout/speculative_acceptance_rate']:.1%}, "
                f"{r['rollout/speculative_tokens_per_pass']:.2f} tokens/pass, saved "
                + ("-" if saved is None else f"{saved:.2f} s"))  # fmt: skip
    print(f"  {method} {label} (seed {r['seed']}): {r['seconds']:.2f} s, tail {r['tail_s']:.2f} s"
          f" ({r['tail_steps']} steps), {r['tokens']} tokens, mean {r['response_mean']:.0f} max "
          f"{r['response_max']} cut {r['cut']}{spec}", flush=True)  # fmt: skip


def engine_calls(model, prompts, method: str, args, device, calls: int, deadline: float,
                 tokenizer, on_call) -> list[dict]:  # fmt: skip
    """A warm-up call then up to `calls` timed ones with speculative=method, stopping where the
    next call would end past `deadline`. -> the records, warm-up first."""
    import torch

    from hybridflow.bench.common import parse_engine_settings
    from hybridflow.engine import Engine, EngineOptions, SamplingParams

    settings = {"speculative_max_rows": args.tail_rows, "cache_dir": args.cache_dir,
                **parse_engine_settings(args.engine), "speculative": method}  # fmt: skip
    options = EngineOptions.from_dict(settings).checked()
    longest = max(map(len, prompts)) + args.max_new_tokens
    engine = Engine(model, len(prompts) * args.samples, longest, options=options)
    records: list[dict] = []
    for index in range(calls + 1):
        if index > 1 and time.monotonic() + records[-1]["seconds"] * 1.2 > deadline:
            print(f"  {method}: {index - 1} timed call(s), the next would pass the phase's "
                  "time limit", flush=True)  # fmt: skip
            break
        params = SamplingParams(n=args.samples, temperature=args.temperature,
                                max_new_tokens=args.max_new_tokens,
                                seed=args.seed + index)  # fmt: skip
        record, completions = call_record(engine, prompts, params, device)
        record["warmup"] = index == 0
        records.append(record)
        show_call(method, "warm-up" if index == 0 else f"call {index}", record)
        if index == 0 and method == "off":
            text = tokenizer.decode(completions[0].token_ids)
            print(f"  a sample: {text[:400]!r}", flush=True)
        on_call(records)
    engine.release()
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def generation_phase(args) -> None:
    import torch

    from hybridflow.models import load_model, load_tokenizer

    work = Path(args.work)
    deadline = time.monotonic() + args.seconds
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args.model_dir, dtype=dtype, device=device).eval()
    tokenizer = load_tokenizer(args.tokenizer_dir or args.model_dir)
    prompts = json.loads((work / "gen_prompts.json").read_text())[: args.prompts]
    result = {"prompts": len(prompts), "samples": args.samples,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "tail_rows": args.tail_rows, "engine": args.engine,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "off": [], "ngram": []}  # fmt: skip
    out = work / "generation.json"

    def saver(method):
        def save(records):
            result[method] = records
            write_json(out, result)

        return save

    # speculation off first: its calls set how many timed calls both make; the speculative
    # engine then makes as many (it is the faster one), with the same seeds
    halfway = time.monotonic() + (deadline - time.monotonic()) / 2
    off = engine_calls(model, prompts, "off", args, device, args.repeats, halfway, tokenizer,
                       saver("off"))  # fmt: skip
    engine_calls(model, prompts, "ngram", args, device, len(off) - 1, deadline, tokenizer,
                 saver("ngram"))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="phase", required=True)
    sft = sub.add_parser("sft")
    sft.add_argument("work")
    sft.add_argument("--preset", default="qwen2.5-0.5b")
    sft.add_argument("--seconds", type=float, required=True, help="optimizer steps' wall time")
    sft.add_argument("--max-steps", type=int, default=100000)
    sft.add_argument("--batch", type=int, default=64)
    sft.add_argument("--lr", type=float, default=6e-4)
    sft.add_argument("--warmup-steps", type=int, default=50)
    sft.add_argument("--decay-steps", type=int, default=800)
    sft.add_argument("--max-length", type=int, default=512)
    sft.add_argument("--micro-tokens", type=int, default=None)
    sft.add_argument("--log-every", type=int, default=50)
    sft.add_argument("--device", default=None)
    gen = sub.add_parser("generation")
    gen.add_argument("work")
    gen.add_argument("--model-dir", required=True)
    gen.add_argument("--tokenizer-dir", default=None)
    gen.add_argument("--seconds", type=float, required=True, help="the phase's time limit")
    gen.add_argument("--prompts", type=int, default=64)
    gen.add_argument("--samples", type=int, default=8)
    gen.add_argument("--max-new-tokens", type=int, default=1024)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--repeats", type=int, default=2, help="timed calls after the warm-up")
    gen.add_argument("--tail-rows", type=int, default=16, help="speculative_max_rows")
    gen.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an EngineOptions field of both engines",
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--cache-dir", default=None)
    gen.add_argument("--device", default=None)
    args = p.parse_args()
    sft_phase(args) if args.phase == "sft" else generation_phase(args)


if __name__ == "__main__":
    main()
