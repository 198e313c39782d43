"""Supervised fine-tuning: loss on response tokens only, packed sequences, checkpoints.

An SFT example is laid out like an RL sample so the actor learner's machinery is reused
as is: ``prompts`` = the first token, ``responses`` = the rest, ``response_mask`` = the loss
mask shifted by one. The loss is the token-mean negative log-likelihood of the masked tokens
over the whole batch (packed micro-batches under ``sft.max_tokens_per_gpu``, accumulated).

    hybridflow sft model.path=/path/to/hf_dir sft.train_files=[data.parquet] sft.total_steps=500
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.config import Config, ConfigError, SFTConfig
from hybridflow.protocol import Batch


def examples_to_batch(examples: Sequence[Any], pad_token_id: int) -> Batch:
    """SFTExamples -> Batch(prompts [b, 1], responses [b, L-1], attention_mask [b, L],
    response_mask [b, L-1]) with right padding."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)  # [b, L]
    attention_mask = torch.zeros(len(examples), width, dtype=torch.long)  # [b, L]
    loss_mask = torch.zeros(len(examples), width)  # [b, L]
    for row, example in enumerate(examples):
        length = len(example.input_ids)
        ids[row, :length] = torch.tensor(example.input_ids)
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = torch.tensor(example.loss_mask, dtype=torch.float32)
    return Batch(
        {
            "prompts": ids[:, :1],
            "responses": ids[:, 1:],
            "attention_mask": attention_mask,
            "response_mask": loss_mask[:, 1:],
        }
    )


class SFTTrainer:
    """Token-mean NLL training of a CausalLM on one device (FSDP2 when distributed is on)."""

    def __init__(self, model: torch.nn.Module, sft_cfg: SFTConfig, device: str, grad_clip: float):
        from hybridflow.learners.core import TrainCore
        from hybridflow.learners.modules import PolicyModel

        self.cfg, self.grad_clip = sft_cfg, grad_clip
        self.steps_done = 0
        self.policy = PolicyModel(model)
        self.core = TrainCore(self.policy, device=device)
        self.core.build_optimizer(
            lr=sft_cfg.lr,
            weight_decay=sft_cfg.weight_decay,
            betas=(0.9, 0.95),
            schedule="cosine",
            warmup_steps=sft_cfg.warmup_steps,
            total_steps=max(sft_cfg.lr_decay_steps or sft_cfg.total_steps, 1),
            min_lr_ratio=sft_cfg.min_lr_ratio,
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.lm

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns loss, grad norm, lr."""
        from hybridflow.algos import agg_loss
        from hybridflow.learners.metric_sums import MetricSums
        from hybridflow.learners.router_terms import router_terms
        from hybridflow.learners.step import accumulate_and_step

        config = self.model.config
        moe = getattr(config, "is_moe", False)  # our decoder's mixture of experts

        def micro_loss(micro, packed, counts):
            trace = [] if moe else None
            logprobs, _ = self.policy(packed, 1.0, False, router_trace=trace)
            logprobs = packed.scatter(logprobs)  # [b, R]
            mask = micro.tensors["response_mask"].to(logprobs.device)
            nll = agg_loss(-logprobs, mask, "token-mean", **counts)
            if not trace:
                return nll, {"loss": nll.detach()}, {}
            # the routing metrics only: a load-balancing loss in the demo's warm start took it
            # 875 steps to 50% greedy accuracy against 650 without, and left GRPO +10.0 points
            # against +22.3 (transformers adds it only with output_router_logits, off by default)
            _, _, means = router_terms(
                trace, config.num_experts, aux_loss_coef=0.0, z_loss_coef=0.0, share=1.0
            )
            return nll, {"loss": nll.detach()}, means

        sums = MetricSums(self.core)
        self.core.module.train()
        skipped = accumulate_and_step(
            self.core,
            batch,
            micro_batch_size=len(batch),
            max_tokens=self.cfg.max_tokens_per_gpu,
            grad_clip=self.grad_clip,
            norm_length=batch.tensors["responses"].shape[1],
            micro_loss=micro_loss,
            sums=sums,
        )
        metrics = {f"sft/{k}": v for k, v in sums.result().items()}
        metrics["sft/lr"] = self.core.optimizer.param_groups[0]["lr"]
        metrics["sft/skipped_steps"] = float(skipped)  # a NaN or inf gradient norm
        return metrics


def run_sft(
    model: torch.nn.Module,
    examples: Sequence[Any],
    sft_cfg: SFTConfig,
    *,
    device: str,
    seed: int,
    pad_token_id: int,
    log: Callable[[dict[str, float], int], None] | None = None,
    checkpoint: Callable[[SFTTrainer, Any, int], None] | None = None,
    save_freq: int = 0,
    resume: Callable[[SFTTrainer, Any], int] | None = None,
    should_stop: Callable[[SFTTrainer, int], bool] | None = None,
    kept: Callable[[], str] = lambda: "no checkpoint is written by this call",
) -> SFTTrainer:
    """``sft.total_steps`` optimizer steps over shuffled ``examples`` (deterministic in
    ``seed``); ``checkpoint(trainer, sampler, step)`` every ``save_freq`` steps and at the end.
    ``should_stop(trainer, step)``, asked after each step, ends training early when True
    (``trainer.steps_done`` says where it stopped). A step whose loss or gradient norm is not
    finite raises TrainingDiverged before it is logged or saved; ``kept()`` says which
    checkpoint the run keeps."""
    from hybridflow.data.sampler import ResumableSampler
    from hybridflow.trainer.lifecycle.divergence import check_update

    torch.manual_seed(seed)
    trainer = SFTTrainer(model, sft_cfg, device, grad_clip=1.0)
    batch_size = min(sft_cfg.batch_size, len(examples))
    sampler = ResumableSampler(len(examples), batch_size, seed=seed)
    start = resume(trainer, sampler) if resume is not None else 0
    trainer.steps_done = start
    for step in range(start + 1, sft_cfg.total_steps + 1):
        batch = examples_to_batch([examples[i] for i in sampler.next_batch()], pad_token_id)
        metrics = trainer.step(batch)
        check_update(metrics, "sft", step=f"SFT step {step}", kept=kept(),
                     fix="resume from it with a lower sft.lr, and look at the examples")  # fmt: skip
        trainer.steps_done = step
        if log is not None:
            log(metrics, step)
        stop = should_stop is not None and should_stop(trainer, step)
        if checkpoint is not None and (
            (save_freq > 0 and step % save_freq == 0)
            or ((step == sft_cfg.total_steps or stop) and save_freq >= 0)
        ):
            checkpoint(trainer, sampler, step)
        if stop:
            break
    return trainer


def load_sft_examples(
    files: Sequence[str], tokenizer, sft_cfg: SFTConfig, *, val_size: int, data_seed: int = 0
):
    """Tokenised examples of ``sft.train_files`` (``builtin:<task>`` or prompt/response /
    chat-message files), those longer than ``sft.max_length`` dropped (count returned).
    ``val_size``: size of the built-in task's validation split, which SFT never sees."""
    from hybridflow.data.sft_examples import iter_sft_rows, tokenize_sft_rows
    from hybridflow.trainer.loop.sft_tasks import builtin_sft_rows

    def rows() -> Iterator[Any]:  # tokenized as read: a row too long is dropped untokenized
        for entry in files:
            if entry.startswith("builtin:"):
                task = entry.removeprefix("builtin:")
                yield from builtin_sft_rows(task, sft_cfg, val_size, data_seed)
            else:
                yield from iter_sft_rows(entry)

    return tokenize_sft_rows(rows(), tokenizer, tokenizer.eos_token_id, sft_cfg.max_length)


def sft_main(cfg: Config, given_keys: Sequence[str] = ()) -> Path:
    """``hybridflow sft``: fine-tune ``model.path`` (or a fresh ``sft.preset`` model when the
    path is ``sft:<task>``) on ``sft.train_files``; writes checkpoints and ``<out>/hf``.
    ``given_keys``: the keys the command line set, refused where SFT never reads them."""
    from hybridflow.config.sft_checks import sft_problems, task_problems, unread_key_problems
    from hybridflow.model_config_values import directory_config_problems
    from hybridflow.trainer.lifecycle.machine import machine_problems
    from hybridflow.trainer.lifecycle.run_lock import hold_run_dir
    from hybridflow.trainer.lifecycle.stop import StopRequest

    sft_cfg = cfg.sft
    out = Path(sft_cfg.out_dir or Path(cfg.trainer.run_dir) / "sft")
    problems = unread_key_problems(list(given_keys)) + task_problems(cfg.model.path, sft_cfg)
    problems += sft_problems(cfg.sft) + machine_problems(cfg, str(out))
    if not cfg.model.path.startswith("sft:"):  # before the tokenizer reads config.json
        problems += [f"model.path: {p}" for p in directory_config_problems(cfg.model.path)]
    if problems:
        raise ConfigError(problems)
    stop = StopRequest()
    with hold_run_dir(out, key="sft.out_dir"), stop.on_signals(print):  # out: <run_dir>/sft
        return _sft(cfg, out, stop)


def _sft(cfg: Config, out: Path, stop) -> Path:
    from hybridflow.models import load_model, load_tokenizer
    from hybridflow.progress import ProgressReporter
    from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager, load_newest_intact
    from hybridflow.trainer.lifecycle.divergence import kept_checkpoint
    from hybridflow.trainer.loop.device import resolve_device
    from hybridflow.trainer.observe.loggers import Tracker
    from hybridflow.workers.model_loading import resolve_dtype, set_cpu_threads

    sft_cfg = cfg.sft
    device = resolve_device(cfg.trainer.device)
    if device == "cuda":
        device = "cuda:0"
    set_cpu_threads(cfg, device)
    model_path = sft_cfg.preset if cfg.model.path.startswith("sft:") else cfg.model.path
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or model_path)
    examples, dropped = load_sft_examples(
        sft_cfg.train_files, tokenizer, sft_cfg, val_size=cfg.data.builtin_val_size
    )
    if not examples:
        raise ConfigError(
            [f"sft.train_files={sft_cfg.train_files}: no example fits sft.max_length"]
        )
    dtype = torch.float32 if cfg.model.dtype == "auto" else resolve_dtype(cfg.model, device)
    model = load_model(model_path, dtype=dtype, device=device)
    checkpoints = CheckpointManager(out / "checkpoints", cfg.trainer.keep_last_k)
    run_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_path))

    def save(trainer: SFTTrainer, sampler, step: int) -> None:
        write_sft_checkpoint(checkpoints, trainer, sampler, step, run_cfg, tokenizer)

    def resume(trainer: SFTTrainer, sampler) -> int:
        loaded = {}

        def load(path: Path) -> None:
            loaded.update(trainer.core.load(path / "actor", trainable_only=False))
            sampler.load_state_dict(loaded["sampler"])

        # a damaged or refused checkpoint falls back to the previous one, as for RL runs
        path = load_newest_intact(checkpoints, cfg.trainer.resume, load, log=print)
        if path is None:
            return 0
        print(f"resumed SFT from {path} (step {loaded['step']})")
        bar.start_done = bar.done = int(loaded["step"])  # this run's steps come after it
        return int(loaded["step"])

    print(f"SFT: {len(examples)} examples ({dropped} longer than sft.max_length dropped)")
    progress = ProgressReporter(interval_s=cfg.trainer.progress_interval_s)
    with (
        stop.graceful("saving a checkpoint after this SFT step, then stopping"),
        progress.collecting_warnings(),
        progress.task("SFT", total=sft_cfg.total_steps, unit="steps") as bar,
        Tracker(
            cfg.trainer.loggers,
            out,
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            progress=progress,
        ) as tracker,  # fmt: skip
    ):

        def log(metrics: dict[str, float], step: int) -> None:
            tracker.log(metrics, step)
            bar.update(step, status=f"loss {metrics['sft/loss']:.3f}")

        trainer = run_sft(
            model,
            examples,
            sft_cfg,
            device=device,
            seed=cfg.trainer.seed,
            pad_token_id=_pad_id(tokenizer),
            log=log,
            checkpoint=save,
            save_freq=cfg.trainer.save_freq,
            resume=resume,
            should_stop=lambda trainer, step: stop.requested,
            kept=lambda: kept_checkpoint(checkpoints.latest_step(), checkpoints.root),
        )
        bar.stopped = trainer.steps_done < sft_cfg.total_steps
    progress.close()
    if trainer.steps_done < sft_cfg.total_steps:  # stopped by the request
        saved = checkpoints.latest()
        what = (f"saved {saved}; run the same command again to resume"
                if checkpoints.latest_step() == trainer.steps_done
                else "nothing was saved (trainer.save_freq=-1)")  # fmt: skip
        raise stop.stopped(f"after SFT step {trainer.steps_done} of {sft_cfg.total_steps}: {what}")
    final = out / "hf"
    with stop.graceful(f"finishing writing {final}, then stopping"):  # the run is done
        save_hf_model(trainer.model, tokenizer, final)
    print(f"wrote the fine-tuned model to {final}")
    return final


def write_sft_checkpoint(checkpoints, trainer, sampler, step, run_cfg, tokenizer) -> Path:
    """Same layout as an RL checkpoint (``actor/``, config, tokenizer): ``hybridflow export``
    works on both."""
    from hybridflow.trainer.lifecycle.run_state import write_model_files

    def write(directory: Path) -> None:
        trainer.core.save(
            directory / "actor",
            {"step": step, "sampler": sampler.state_dict()},
            trainable_only=False,
        )
        write_model_files(directory, run_cfg, tokenizer, trainer.model.dtype)

    return checkpoints.save(step, write, metadata={"kind": "sft"})


def save_hf_model(model: torch.nn.Module, tokenizer, directory: Path) -> None:
    """Model (save_pretrained) + tokenizer, as one Hugging Face directory."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
