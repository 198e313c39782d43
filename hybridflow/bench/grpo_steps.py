"""Time whole GRPO steps of the real loop on a fixed workload (benchmarks/grpo_vs_trl.py).

The step is ``trainer.rl_loop.train_step``: the same code ``hybridflow train`` runs. Only the
prompt source (fixed token-id prompts, no chat template) and the reward (random scores, so
advantages and gradients are non-zero) are replaced, to match the peer's workload.

``gpus > 1`` runs the ``local`` backend: one worker process per device, each with an FSDP2
shard of the actor and a rollout engine of its own; the prompts are split over the ranks.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import torch

from hybridflow.config import Config, load_config, validate
from hybridflow.progress import ProgressReporter, quiet_reporter
from hybridflow.protocol import Batch
from hybridflow.trainer.loop.compile_policy import compile_defaults
from hybridflow.trainer.loop.stages import RunContext
from hybridflow.trainer.plan.memory_check import memory_defaults


class FixedPrompts:
    """A loader that returns the same prompts every step, left-padded with ``pad_token_id``;
    ``images`` (an engine PromptImages, or None, a prompt): their pixels, grids and mRoPE
    rows in the batch as the data path puts them (data/image_batch.py)."""

    def __init__(self, prompts: list[list[int]], images: list | None = None,
                 pad_token_id: int = 0):  # fmt: skip
        from hybridflow.data.image_batch import prompt_image_fields

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # [B, P]
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        tensors = {"prompts": ids, "attention_mask": mask}
        arrays = {
            "data_source": np.asarray(["bench"] * len(prompts), dtype=object),
            "ground_truth": np.asarray([""] * len(prompts), dtype=object),
            "extra_info": np.asarray([{}] * len(prompts), dtype=object),
            # token ids without a text: a reward model reads the policy's tokens
            "raw_prompt": np.asarray([""] * len(prompts), dtype=object),
        }
        if images is not None:
            rows = [torch.arange(len(p)).expand(3, len(p)) if e is None or e.positions is None
                    else e.positions for p, e in zip(prompts, images)]  # fmt: skip
            image_tensors, image_arrays = prompt_image_fields(
                rows, [None if e is None else e.pixel_values for e in images],
                [None if e is None else e.image_grid_thw for e in images], width,
            )  # fmt: skip
            tensors.update(image_tensors)
            arrays.update(image_arrays)
        self.batch = Batch(tensors=tensors, arrays=arrays)

    def next_batch(self) -> Batch:
        return Batch(dict(self.batch.tensors), dict(self.batch.arrays), {})

    def state_dict(self) -> dict[str, Any]:
        return {}


@dataclasses.dataclass
class _Result:
    scores: list[float]
    metrics: dict[str, float]


class RandomReward:
    """Uniform random scores in [0, 1): the peer benchmark's reward, seeded."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def score(
        self, responses, ground_truths, data_sources, extra_infos=None, response_lengths=None
    ):
        return _Result([self.rng.random() for _ in responses], {})

    def close(self) -> None:
        pass


def bench_config(
    model_path: str,
    *,
    prompts: int,
    samples: int,
    prompt_len: int,
    new_tokens: int,
    micro_batch_tokens: int,
    gpus: int = 1,
    overrides: tuple[str, ...] = (),
) -> Config:
    """The GRPO-vs-TRL workload (benchmarks/grpo_vs_trl.py) as a hybridflow config: one optimizer step per generation batch,
    lr 1e-6, no reference model, bf16, gradient checkpointing (``overrides`` may set it to
    auto: time_grpo_steps lets the memory plan decide), no early stop.

    ``prompts`` is the global batch; each of the ``gpus`` rollout engines gets
    ``prompts / gpus`` of them (``rollout.max_num_seqs`` is per engine)."""
    if prompts % gpus:
        raise ValueError(f"{prompts} prompts do not split evenly over {gpus} GPUs")
    placement = ["trainer.backend=local", f"trainer.n_gpus_per_node={gpus}"] if gpus > 1 else []
    cfg = load_config(
        None,
        [
            f"model.path={model_path}",
            f"model.tokenizer_path={model_path}",
            "model.gradient_checkpointing=true",
            f"data.train_batch_size={prompts}",
            f"data.max_prompt_length={prompt_len}",
            f"data.max_response_length={new_tokens}",
            f"rollout.n={samples}",
            "rollout.ignore_eos=true",
            f"rollout.max_num_seqs={prompts // gpus * samples}",
            f"actor.ppo_mini_batch_size={prompts}",
            f"actor.max_tokens_per_gpu={micro_batch_tokens}",
            "actor.lr=1e-6",
            "actor.use_kl_loss=false",
            "algorithm.adv_estimator=grpo",
            "trainer.loggers=[]",
            "trainer.val_before_train=false",
            *placement,
            *overrides,
        ],
    )
    return compile_defaults(cfg, log=lambda line: None)  # as `hybridflow train` resolves it


def step_line(step: int, timings: dict[str, float]) -> str:
    """``step 2: 41.3 s (gen 30.2, update_actor 9.8)``: a step's time and its stages."""
    stages = ", ".join(f"{k.removeprefix('timing_s/')} {v:.1f}" for k, v in timings.items()
                       if k != "timing_s/step")  # fmt: skip
    return f"step {step}: {timings['timing_s/step']:.1f} s ({stages})"


def time_grpo_steps(
    *,
    model_path: str,
    prompts: list[list[int]],
    samples_per_prompt: int,
    new_tokens: int,
    steps: int,
    micro_batch_tokens: int | str = 65536,
    gpus: int = 1,
    overrides: tuple[str, ...] = (),
    tokenizer: Any = None,
    progress: ProgressReporter | None = None,
    reward_weights: dict[str, dict[str, float]] | None = None,
    images: list | None = None,
) -> tuple[list[float], list[float], dict[str, float]]:
    """Run ``steps`` GRPO steps on ``gpus`` devices (``prompts`` is the global batch).

    ``progress``: where building the roles and each step report (a line per finished step
    with its stages; a status line in silences; default: nothing printed). A 7B step of
    16k-token responses takes minutes, and a benchmark cut short by its time limit should
    have said how far it got. ``reward_weights``: how the reward parts combine (e.g.
    ``{"*": {"model": 1.0}}`` with ``reward.model.path`` in ``overrides``); default: the
    random scores alone. ``images``: an engine PromptImages (or None) a prompt, for a
    vision-language model (bench/image_prompts.py); prompts of unequal lengths are
    left-padded with the tokenizer's pad id.

    Returns (seconds per step, peak allocated GiB of each rank's GPU over all steps, empty
    on CPU; mean stage timings of the steps after the first)."""
    from hybridflow.models import load_tokenizer
    from hybridflow.trainer.loop.rl_loop import train_step
    from hybridflow.trainer.loop.roles import build_roles

    cfg = bench_config(
        model_path,
        prompts=len(prompts),
        samples=samples_per_prompt,
        prompt_len=max(len(p) for p in prompts),
        new_tokens=new_tokens,
        micro_batch_tokens=micro_batch_tokens,
        gpus=gpus,
        overrides=overrides,
    )
    # the memory plan's choices (model.gradient_checkpointing=auto, null log-prob budgets)
    # for the visible GPU, as `hybridflow train` makes them at run start
    cfg = memory_defaults(cfg, log=lambda line: None)
    derived = validate(cfg)
    progress = progress or quiet_reporter()
    with progress.task("building the actor and the rollout engine"):
        roles = build_roles(cfg, derived)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
    run = RunContext(
        cfg=cfg,
        derived=derived,
        roles=roles,
        tokenizer=tokenizer,
        loader=FixedPrompts(prompts, images, getattr(tokenizer, "pad_token_id", None) or 0),
        val_dataset=None,
        reward=RandomReward(),
        kl_ctrl=None,
        tracker=None,
        checkpoints=None,
        progress=progress,
        reward_weights=reward_weights or {"*": {"rule": 1.0}},
    )
    times, per_step = [], []
    try:
        # Asked of the workers: with the local backend the controller never touches a GPU.
        roles.actor.device_memory(reset=True)
        with progress.task("GRPO steps", total=steps, unit="steps"):
            for _ in range(steps):
                run.step += 1
                metrics = train_step(run)
                times.append(metrics["timing_s/step"])
                per_step.append({k: v for k, v in metrics.items() if k.startswith("timing_s/")})
                progress.set_done(run.step)
                progress.print(step_line(run.step, per_step[-1]))
        # One entry per rank; CPU workers report nothing.
        peaks = [m["max_allocated_gib"] for m in roles.actor.device_memory() if m]
    finally:
        roles.shutdown()
    timed = per_step[1:] or per_step
    breakdown = {k: sum(m.get(k, 0.0) for m in timed) / len(timed) for k in timed[0]}
    return times, peaks, breakdown
