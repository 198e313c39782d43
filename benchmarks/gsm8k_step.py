"""`python benchmarks/gsm8k_step.py --input gsm8k/train.jsonl`: seconds per GRPO step of
examples/gsm8k.yaml as shipped, on a random-weight model of its shape, with each stage and MFU.

    python benchmarks/gsm8k_step.py --input ../shared/data/gsm8k/train.jsonl     # 0.5b, 4 steps
    python benchmarks/gsm8k_step.py --input ../shared/data/gsm8k/train.jsonl --preset tiny \\
        --vocab 512 --device cpu --steps 2 --override data.train_batch_size=4 \\
        --override actor.ppo_mini_batch_size=2 --override rollout.n=2 \\
        --override data.max_response_length=8                               # smoke run

The run is `hybridflow train --config examples/gsm8k.yaml` in a fresh process, as a user
starts it: the data converted by `hybridflow data gsm8k`, model.path a random-weight checkpoint
of --preset (--vocab replaces its vocabulary size) with beside it a byte-level BPE tokenizer
trained on the questions (Qwen's chat-template form, `<|im_end|>` its end of sequence), no
validation and no checkpoints. Random weights rarely sample the end of sequence, so responses
run to the example's 512 tokens: the long end of a real run's. Printed: each step as it ends,
then the mean of the steps after --warmup (the first compiles): s/step, each stage's seconds
(timing_s/*), perf/mfu where the GPU's peak is known, tokens/s, and on a known GPU a row of
each stage's floor (hybridflow/trainer/plan/stage_floors.py); --json writes it. The reward runs
beside the first forward pass (old log-probs), whose time is then what it took beyond the
reward: with a slow reward it can fall under its floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_run import CLI, REPO, run_train, timed_run_overrides  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(questions: list[str], vocab_size: int, out_dir: Path):
    """A byte-level BPE of vocab_size ids trained on the questions, with Qwen's specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(questions, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_model_dir(preset: str, vocab: int | None, tokenizer, out_dir: Path) -> None:
    """A random-weight checkpoint of the preset (vocab: its vocabulary size replaced) whose
    end-of-sequence and pad ids are the tokenizer's."""
    import torch

    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    config = preset_config(preset)
    if vocab is not None:
        config = dataclasses.replace(config, vocab_size=vocab)
    build_model(config, dtype=torch.float32).save_pretrained(str(out_dir))
    config_path = out_dir / "config.json"
    hf_config = json.loads(config_path.read_text())
    hf_config["eos_token_id"] = tokenizer.eos_token_id
    hf_config["pad_token_id"] = tokenizer.pad_token_id
    config_path.write_text(json.dumps(hf_config, indent=1))


def convert_data(input_path: str, out_dir: Path) -> Path:
    """`hybridflow data gsm8k` as a user runs it. -> the parquet file."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run([sys.executable, "-c", CLI, "data", "gsm8k", "--input", input_path,
                           "--out", str(out_dir), "--split", "train"], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"hybridflow data gsm8k failed:\n{done.stdout}{done.stderr}")
    return out_dir / "train.parquet"


def summary(steps: list[dict], warmup: int) -> dict:
    """The mean of the steps after the first `warmup` (of all, if no more ran)."""
    timed = steps[warmup:] or steps
    keys = sorted({k for row in timed for k in row if k.startswith("timing_s/")})
    mean = lambda key: sum(row.get(key, 0.0) for row in timed) / len(timed)  # noqa: E731
    return {
        "steps_s": [row["timing_s/step"] for row in steps],
        "timed_steps": len(timed),
        "stages_s": {k.removeprefix("timing_s/"): mean(k) for k in keys},
        "mfu": mean("perf/mfu") if all("perf/mfu" in row for row in timed) else None,
        "tokens_per_s": mean("perf/tokens_per_s"),
        "response_mean": mean("response_length/mean"),
        "prompt_mean": mean("prompt_length/mean"),
    }


def stage_floors_for(overrides: list[str], result: dict, model_dir: Path) -> dict[str, float]:
    """Each stage's floor (hybridflow/trainer/plan/stage_floors.py) at the run's realised mean prompt
    and response lengths, for the visible GPU; {} on a CPU or an unknown GPU. Called after
    the run (the CUDA context it opens would otherwise sit beside the training)."""
    import torch

    from hybridflow.config import load_config
    from hybridflow.trainer.observe.metrics import peak_flops_per_gpu
    from hybridflow.trainer.plan.architecture import model_architecture
    from hybridflow.trainer.plan.memory_check import memory_defaults
    from hybridflow.trainer.plan.stage_floors import StepShape, peak_bandwidth, stage_floors

    config_file, keys = overrides[1], overrides[2:]  # "--config", the file, key=value...
    cfg = load_config(config_file, keys)
    if cfg.trainer.device == "cpu" or not torch.cuda.is_available():
        return {}
    cfg = memory_defaults(cfg, log=lambda line: None)  # the checkpointing the run chose
    name = torch.cuda.get_device_name()
    shape = StepShape(cfg.data.train_batch_size, cfg.rollout.n, round(result["prompt_mean"]),
                      round(result["response_mean"]))  # fmt: skip
    floors = stage_floors(model_architecture(str(model_dir)), shape, peak_flops_per_gpu(name),
                          peak_bandwidth(name), recompute=bool(cfg.model.gradient_checkpointing))  # fmt: skip
    return {k.removeprefix("timing_s/"): v for k, v in floors.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="GSM8K jsonl with 'question' and 'answer'")
    p.add_argument("--config", default=str(REPO / "examples" / "gsm8k.yaml"))
    p.add_argument("--preset", default="qwen2.5-0.5b", help="the model's shape")
    p.add_argument("--vocab", type=int, default=None, help="replace the preset's vocabulary size")
    p.add_argument("--tokenizer-vocab", type=int, default=8192, help="BPE ids (≤ --vocab)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the mean")
    p.add_argument("--device", default=None, help="trainer.device (cpu: a smoke run)")
    p.add_argument("--override", action="append", default=[], help="a config key=value")
    p.add_argument("--work-dir", default=None, help="model, data and run (default: a temp dir)")
    p.add_argument("--run-timeout", type=float, default=3000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not Path(args.input).is_file():
        raise SystemExit(f"--input {args.input}: no such file (the GSM8K train split as jsonl)")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-gsm8k-"))
    work.mkdir(parents=True, exist_ok=True)
    questions = [json.loads(line)["question"] for line in open(args.input) if line.strip()]
    vocab = min(args.tokenizer_vocab, args.vocab or args.tokenizer_vocab)
    tokenizer = build_tokenizer(questions, vocab, work / "tokenizer")
    build_model_dir(args.preset, args.vocab, tokenizer, work / "model")
    train_file = convert_data(args.input, work / "data")
    run_dir = work / "run"
    overrides = [
        "--config", args.config,
        f"model.path={work / 'model'}",
        f"model.tokenizer_path={work / 'tokenizer'}",
        f"data.train_files=[{train_file}]",
        *timed_run_overrides(args.steps, run_dir, work / "cache", args.device),
        *args.override,
    ]  # fmt: skip
    steps, complete = run_train(overrides, "gsm8k", run_dir, args.run_timeout)
    if not steps:
        raise SystemExit(1)
    result = {"preset": args.preset, "complete": complete, **summary(steps, args.warmup)}
    result["floors_s"] = floors = stage_floors_for(overrides, result, work / "model")
    stages = result["stages_s"]
    order = ["step"] + [k for k in stages if k != "step"]
    print(f"\nexamples/gsm8k.yaml, {args.preset}, random weights; mean of steps "
          f"{args.warmup + 1}..{len(steps)}{'' if complete else ' (stopped at --run-timeout)'}; "
          f"responses {result['response_mean']:.0f} tokens on average")  # fmt: skip
    print("| " + " | ".join(f"{k} s" for k in order) + " | MFU | tokens/s |")
    print("|" + "---|" * (len(order) + 2))
    mfu = "-" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
    print("| " + " | ".join(f"{stages[k]:.2f}" for k in order)
          + f" | {mfu} | {result['tokens_per_s']:,.0f} |")  # fmt: skip
    if floors:  # at the GPU's peak: how far each stage is from its hardware bound
        print("| " + " | ".join(f"floor {floors[k]:.2f}" if k in floors else "" for k in order)
              + " | | |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
