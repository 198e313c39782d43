"""The TRL side of benchmarks/grpo_vs_trl.py: TRL's GRPOTrainer on the same workload (its
own ``model.generate``, a reward of random numbers), timed step by step."""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import grpo_vl  # noqa: E402
from grpo_model import load_word_tokenizer  # noqa: E402
from grpo_report import mean_prompt_length, package_version, step_summary  # noqa: E402


def run_trl(model_dir: str, prompts: list[list[int]], args, made=None) -> dict:
    """TRL's GRPOTrainer on the text ``prompts``; ``made`` (grpo_vl.image_prompts): their
    images too, in an ``images`` column, through the model's processor."""
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = load_word_tokenizer(model_dir)
    texts = [" ".join(f"w{i}" for i in p) for p in prompts]
    assert len(tok(texts[0])["input_ids"]) == args.prompt_len, (
        "prompt must tokenize to prompt-len ids"
    )
    n_prompts_total = args.prompts * args.steps
    if made is None:
        from datasets import Dataset

        ds = Dataset.from_dict({"prompt": (texts * args.steps)[:n_prompts_total]})
    else:
        ds = grpo_vl.trl_dataset(texts, made.pictures, args.steps)

    def random_reward(completions, **kwargs):
        return [random.random() for _ in completions]

    cuda = torch.cuda.is_available()
    samples = args.prompts * args.samples
    micro = min(args.trl_micro_batch, samples)
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro,
        steps_per_generation=samples // micro,  # one optimizer step per generation batch
        num_generations=args.samples,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        learning_rate=1e-6,
        beta=0.0,
        num_iterations=1,
        bf16=cuda,
        gradient_checkpointing=True,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=not cuda,
        shuffle_dataset=False,
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    if made is None:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="sdpa"
        )
    else:
        model = grpo_vl.load_trl_model(model_dir, dtype)

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=random_reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok if made is None else grpo_vl.trl_processor(model_dir),
        callbacks=[StepTimer()],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    del trainer, model
    if cuda:
        torch.cuda.empty_cache()
    return step_summary(
        "TRL " + package_version("trl"), times, args, peak, prompt_tokens=mean_prompt_length(made)
    )
