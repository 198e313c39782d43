"""Speculative decoding of the long tail, measured on a checkpoint trained here to write GSM8K
solutions: the engine's generation phase and GRPO steps, with and without speculation.

    python benchmarks/speculative_tail.py --input gsm8k/train.jsonl --json result.json
    python benchmarks/speculative_tail.py --input gsm8k/train.jsonl --model-dir DIR  # no SFT
    python benchmarks/speculative_tail.py --input tiny.jsonl --preset tiny --device cpu \\
        --tokenizer-vocab 512 --sft-seconds 5 --gen-prompts 2 ...                # smoke run

Random weights repeat nothing, so n-gram drafts accept nothing; a model that writes the
task's text repeats its numbers and phrases ("<<48/2=24>>24"). Phases, one after the
other, each in a process of its own under a time limit (--budget-s in all), each printing
as it goes and its result kept in --json before the next starts:

1. prepare: a byte-level BPE tokenizer trained on the questions and solutions (Qwen's chat
   template, `<|im_end|>` its end of sequence), the SFT rows (question and the instruction
   of `hybridflow data gsm8k` -> the solution), the RL prompt rows and the engine's prompts
   (the input's last rows, held out of the SFT);
2. sft (benchmarks/speculative_phases.py): a fresh --preset model, its vocabulary the
   tokenizer's, trained for --sft-seconds and saved with its tokenizer (skipped with
   --model-dir);
3. generation: the engine on --gen-prompts questions × --gen-samples at temperature 1 up to
   --gen-max-new-tokens, speculation off then on, the same seeds: each call's seconds, the
   long tail's (the steps with at most --tail-rows rows decoding: scheduling/tail.py), the
   acceptance rate, tokens per verify pass and the tail seconds the engine says it saved
   (the draft store holds the earlier calls' samples of the same prompts: a later epoch);
4. rl: `hybridflow train` GRPO runs of --rl-modes on the checkpoint (benchmarks/async_rl.py's
   runs, --model-dir), distinct prompts every step (the draft store holds a group's siblings,
   no earlier epoch), --rl-steps each, the mean of the steps after --rl-warmup and before the
   last; the update runs eager (model.compile=false: a cold compile would take most of a
   short run; --rl-override model.compile=true to change it).

Targets: the tail ≥ 1.5× faster, a sync step ≥ 1.2×. Exit 1 when a
phase failed or was skipped (what the others measured is printed and kept).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from speculative_phases import write_json  # noqa: E402
from speculative_report import print_generation, print_rl  # noqa: E402
from train_run import REPO  # noqa: E402

PHASES = Path(__file__).parent / "speculative_phases.py"
RL_OVERRIDES = ["model.compile=false", "rollout.temperature=1.0"]
RL_MODES = ["sync", "sync:spec", "async:1:partial", "async:1:partial:spec"]


class Report:
    """The result so far, written to --json after every phase (and every failure)."""

    def __init__(self, path: str | None, args):
        self.path = Path(path) if path else None
        self.data: dict = {"args": vars(args), "errors": {}}
        self.started = time.monotonic()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def error(self, phase: str, message: str) -> None:
        print(f"{phase}: {message}", flush=True)
        self.data["errors"][phase] = message
        self.save()

    def save(self) -> None:
        if self.path is not None:
            write_json(self.path, self.data)

    def banner(self, phase: str, limit: float | None = None) -> None:
        within = f", within {limit:.0f} s" if limit is not None else ""
        print(f"\n== {phase} ({time.monotonic() - self.started:.0f} s in{within})", flush=True)


def read_gsm8k(path: str, limit: int | None) -> list[dict]:
    """The GSM8K rows ({"question", "answer"}) of a jsonl file; SystemExit naming a bad row."""
    if not Path(path).is_file():
        raise SystemExit(f"--input {path}: no such file (the GSM8K train split as jsonl)")
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("question"), str) or "####" not in str(row.get("answer")):
                raise SystemExit(f"--input {path}, line {number}: a GSM8K row needs 'question' "
                                 "and an 'answer' ending in '#### <number>'")  # fmt: skip
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise SystemExit(f"--input {path}: no rows")
    return rows


def split_rows(rows: list[dict], gen_prompts: int, rl_prompts: int) -> tuple[list, list, list]:
    """(SFT rows, the engine's, the RL runs'): the last gen_prompts + rl_prompts rows are held
    out of the SFT, so the measured prompts are questions the model never saw solved (its
    own memorised solutions would agree with their siblings more than a model's text does).
    SystemExit when no row is left to train on."""
    held = gen_prompts + rl_prompts
    if len(rows) <= held:
        raise SystemExit(f"--input: {len(rows)} rows, and {gen_prompts} (--gen-prompts) + "
                         f"{rl_prompts} (--rl-prompts × --rl-steps) are held out of the SFT: "
                         "give more rows or fewer prompts")  # fmt: skip
    return rows[:-held], rows[-held:][:gen_prompts], rows[-held:][gen_prompts:]


def prepare(work: Path, args, report: Report) -> dict:
    """The tokenizer (unless --model-dir brings one), the SFT rows, the RL prompt rows and
    the engine's prompt ids under work. -> the workload's facts."""
    from gsm8k_step import build_tokenizer

    from hybridflow.data.chat import encode_chat_prompt
    from hybridflow.data.gsm8k import INSTRUCTION, gsm8k_row
    from hybridflow.models import load_tokenizer

    rows = read_gsm8k(args.input, args.sft_examples)
    sft_rows, gen_rows, rl_rows = split_rows(rows, args.gen_prompts,
                                             args.rl_prompts * args.rl_steps)  # fmt: skip
    if args.model_dir:
        tokenizer = load_tokenizer(args.tokenizer_dir or args.model_dir)
    else:
        texts = [text for row in sft_rows for text in (row["question"], row["answer"])]
        tokenizer = build_tokenizer(texts, args.tokenizer_vocab, work / "tokenizer")
    with (work / "sft.jsonl").open("w") as f:
        for row in sft_rows:
            prompt = [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}]
            f.write(json.dumps({"prompt": prompt, "response": row["answer"]}) + "\n")
    rl_rows = [gsm8k_row(row["question"], row["answer"], "train", i)
               for i, row in enumerate(rl_rows)]  # fmt: skip
    with (work / "prompts.jsonl").open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rl_rows)
    gen_ids = [encode_chat_prompt(tokenizer, gsm8k_row(row["question"], row["answer"], "train",
                                                       i)["prompt"])
               for i, row in enumerate(gen_rows)]  # fmt: skip
    (work / "gen_prompts.json").write_text(json.dumps(gen_ids))
    rl_lengths = [len(encode_chat_prompt(tokenizer, row["prompt"])) for row in rl_rows]
    facts = {"sft_rows": len(sft_rows), "vocab": len(tokenizer), "rl_prompts": len(rl_rows),
             "rl_prompt_max": max(rl_lengths), "gen_prompts": len(gen_ids),
             "gen_prompt_mean": sum(map(len, gen_ids)) / len(gen_ids)}  # fmt: skip
    report.put("prepare", facts)
    print(f"prepare: {facts}", flush=True)
    return facts


def run_phase(phase: str, argv: list[str], limit: float, report: Report) -> bool:
    """benchmarks/speculative_phases.py `argv` in a fresh process, its output shown as it
    comes, stopped after `limit` seconds. -> whether it ended well."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                              "")]))  # fmt: skip
    try:
        done = subprocess.run([sys.executable, str(PHASES), *argv], env=env, timeout=limit)
    except subprocess.TimeoutExpired:
        report.error(phase, f"stopped after its time limit of {limit:.0f} s")
        return False
    if done.returncode != 0:
        report.error(phase, f"failed (exit {done.returncode}); its output is above")
        return False
    return True


def tokenizer_dir(work: Path, args) -> Path:
    """The checkpoint's tokenizer: --tokenizer-dir, --model-dir's, or the one prepared (the
    SFT checkpoint holds a copy; its own directory keeps AutoTokenizer off the model type's
    tokenizer class)."""
    return Path(args.tokenizer_dir or args.model_dir or work / "tokenizer")


def left(args, report: Report) -> float:
    return args.budget_s - (time.monotonic() - report.started)


def sft(work: Path, args, report: Report) -> str | None:
    """The SFT phase. -> the checkpoint's directory, None when it failed."""
    limit = min(args.sft_seconds + args.sft_margin_s, left(args, report))
    report.banner("sft", limit)
    argv = ["sft", str(work), "--preset", args.preset, "--seconds", str(args.sft_seconds),
            "--batch", str(args.sft_batch), "--lr", str(args.sft_lr),
            "--max-length", str(args.sft_max_length),
            *(["--device", args.device] if args.device else [])]  # fmt: skip
    if not run_phase("sft", argv, limit, report):
        return None
    report.put("sft", json.loads((work / "sft.json").read_text()))
    return report.data["sft"]["model_dir"]


def generation(work: Path, model_dir: str, args, report: Report) -> None:
    limit = min(args.gen_seconds, left(args, report) - args.rl_reserve_s)
    report.banner("generation", limit)
    if limit < 10:
        report.error("generation", f"skipped: {limit:.0f} s left of --budget-s for it")
        return
    argv = ["generation", str(work), "--model-dir", model_dir,
            "--tokenizer-dir", str(tokenizer_dir(work, args)), "--seconds", str(limit - 15),
            "--prompts", str(args.gen_prompts),
            "--samples", str(args.gen_samples), "--max-new-tokens", str(args.gen_max_new_tokens),
            "--repeats", str(args.gen_repeats), "--tail-rows", str(args.tail_rows),
            "--cache-dir", str(work / "cache"),
            *(f"--engine={setting}" for setting in args.gen_engine),
            *(["--device", args.device] if args.device else [])]  # fmt: skip
    ok = run_phase("generation", argv, limit, report)
    path = work / "generation.json"
    if path.exists():  # what it measured, also when it was stopped
        report.put("generation", json.loads(path.read_text()))
        print_generation(report.data["generation"])
    elif ok:
        report.error("generation", "ended without writing its result")


def rl(work: Path, model_dir: str, facts: dict, args, report: Report) -> None:
    """Each --rl-modes run through benchmarks/async_rl.py's run_mode."""
    import async_rl

    (work / "reward.py").write_text(async_rl.REWARD)
    runs = argparse.Namespace(
        model_dir=model_dir, tokenizer_dir=str(tokenizer_dir(work, args)),
        prompts_file=work / "prompts.jsonl",
        prompts=args.rl_prompts, samples=args.rl_samples, prompt_len=facts["rl_prompt_max"],
        max_new_tokens=args.rl_max_new_tokens, micro_tokens=args.rl_micro_tokens,
        override=[*RL_OVERRIDES, *args.rl_override], device=args.device, steps=args.rl_steps,
        warmup=args.rl_warmup, run_timeout=0.0,
    )  # fmt: skip
    results = []
    for index, mode in enumerate(args.rl_modes):
        limit = min(args.rl_seconds, left(args, report) / (len(args.rl_modes) - index))
        report.banner(f"rl {mode}", limit)
        if limit < args.rl_min_s:
            report.error(f"rl {mode}", f"skipped: {limit:.0f} s left of --budget-s for it")
            continue
        runs.run_timeout = limit
        result = async_rl.run_mode(mode, work, runs)
        if result is None:
            report.error(f"rl {mode}", "finished no step; its last log lines are above")
            continue
        results.append(result)
        report.put("rl", results)
        print(f"{mode}: {result['step_s']:.2f} s/step, steps (s) "
              + " ".join(f"{s:.2f}" for s in result["steps_s"]), flush=True)  # fmt: skip
    if results:
        print_rl(results, args.rl_warmup)


def check_settings(args) -> None:
    """--gen-engine and --rl-override checked before anything runs (SystemExit naming them):
    a typo would otherwise surface minutes in, after the SFT."""
    from hybridflow.bench.common import parse_engine_settings
    from hybridflow.config import ConfigError, load_config
    from hybridflow.engine.options import EngineOptions

    try:
        EngineOptions.from_dict(parse_engine_settings(args.gen_engine)).checked()
    except (ValueError, TypeError) as error:
        raise SystemExit(f"--gen-engine: {error}") from None
    try:
        load_config(None, [*RL_OVERRIDES, *args.rl_override])
    except ConfigError as error:
        raise SystemExit(f"--rl-override: {error}") from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="GSM8K jsonl ('question', 'answer')")
    p.add_argument("--work-dir", default=None, help="default: a temporary directory")
    p.add_argument("--json", default=None, help="the result, rewritten after every phase")
    p.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    p.add_argument("--budget-s", type=float, default=540, help="every phase together")
    p.add_argument("--preset", default="qwen2.5-0.5b", help="the SFT model's shape")
    p.add_argument("--tokenizer-vocab", type=int, default=8192, help="BPE ids = model vocab")
    p.add_argument("--model-dir", default=None, help="a trained checkpoint: no SFT")
    p.add_argument("--tokenizer-dir", default=None, help="--model-dir's tokenizer (default: it)")
    p.add_argument("--sft-seconds", type=float, default=120, help="SFT optimizer steps' time")
    p.add_argument("--sft-margin-s", type=float, default=60, help="SFT start-up and saving")
    p.add_argument("--sft-batch", type=int, default=64)
    p.add_argument("--sft-lr", type=float, default=6e-4)
    p.add_argument("--sft-max-length", type=int, default=512, help="longer examples dropped")
    p.add_argument(
        "--sft-examples",
        type=int,
        default=None,
        help="rows read, the measured prompts' among them (default: all)",
    )
    p.add_argument("--gen-prompts", type=int, default=64)
    p.add_argument("--gen-samples", type=int, default=8)
    p.add_argument("--gen-max-new-tokens", type=int, default=1024)
    p.add_argument("--gen-repeats", type=int, default=2, help="timed calls of each engine")
    p.add_argument("--gen-seconds", type=float, default=120, help="the generation phase's limit")
    p.add_argument("--tail-rows", type=int, default=16, help="speculative_max_rows")
    p.add_argument("--gen-engine", action="append", default=[], metavar="NAME=VALUE",
                   help="an EngineOptions field of the generation phase's engines "
                        "(speculative_draft_tokens=6); RL runs: --rl-override "
                        "rollout.engine.NAME=VALUE")  # fmt: skip
    p.add_argument("--rl-modes", nargs="+", default=RL_MODES)
    p.add_argument("--rl-prompts", type=int, default=16)
    p.add_argument("--rl-samples", type=int, default=8)
    p.add_argument("--rl-max-new-tokens", type=int, default=1024)
    p.add_argument("--rl-steps", type=int, default=4)
    p.add_argument("--rl-warmup", type=int, default=1, help="first steps left out of the mean")
    p.add_argument("--rl-micro-tokens", default="32768", help="actor.max_tokens_per_gpu")
    p.add_argument("--rl-seconds", type=float, default=100, help="the most one mode may take")
    p.add_argument("--rl-min-s", type=float, default=40, help="a mode with less is skipped")
    p.add_argument("--rl-reserve-s", type=float, default=240,
                   help="kept for the RL runs out of the generation phase's")  # fmt: skip
    p.add_argument("--rl-override", action="append", default=[], help="a train config key=value")
    args = p.parse_args(argv)
    import async_rl

    for mode in args.rl_modes:
        async_rl.mode_overrides(mode)  # a bad mode stops here, before anything runs
    check_settings(args)
    for flag, path in (("--model-dir", args.model_dir), ("--tokenizer-dir", args.tokenizer_dir)):
        if path is not None and not Path(path, "config.json" if flag == "--model-dir"
                                         else "").exists():  # fmt: skip
            raise SystemExit(f"{flag} {path}: no such checkpoint directory")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-spec-"))
    work.mkdir(parents=True, exist_ok=True)
    report = Report(args.json, args)
    report.banner("prepare")
    facts = prepare(work, args, report)
    model_dir = args.model_dir or sft(work, args, report)
    if model_dir is None:
        raise SystemExit("no checkpoint to measure on: the SFT phase failed (above)")
    generation(work, model_dir, args, report)
    rl(work, model_dir, facts, args, report)
    report.put("seconds", time.monotonic() - report.started)
    print(f"\ndone in {report.data['seconds']:.0f} s; work directory {work}", flush=True)
    if report.data["errors"]:
        print("phases that failed or were skipped: " + ", ".join(report.data["errors"]))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
