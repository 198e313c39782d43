"""``model.path = sft:<task>``: a tiny model SFT-trained on a built-in task, trained once and
cached under ``trainer.cache_dir`` keyed by a hash of everything that shapes it.

The demo's warm start: a short SFT leaves the model partly right, so RL has room to improve
it. It stops once greedy accuracy reaches ``sft.stop_at_accuracy`` (checked every
``sft.eval_every`` steps, ``sft.total_steps`` the cap) rather than after a fixed step count,
because the step at which the tiny model "gets" addition depends on the seed and on the host's
floating-point paths (AVX-512, AVX2 and scalar kernels round differently: docs/performance.md,
Demo).

``sft.carry_error_rate`` can make the arithmetic demonstrations imperfect on purpose (answers
that need a carry written with the carry forgotten, as a careless student would); measured
here, such noise slows SFT down a lot (loss 1.25 vs 0.35 after 400 steps at a rate of 0.35),
so the default is clean data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from hybridflow.config import Config, ConfigError, SFTConfig
from hybridflow.trainer.loop.published_model import COMPLETE, publish
from hybridflow.trainer.loop.sft_tasks import accuracy_problems, user_turn

SFT_PREFIX = "sft:"
CACHE_VERSION = 1


def greedy_accuracy(model, tokenizer, problems, max_new_tokens: int = 8) -> float:
    """Fraction of ``problems`` (question, answer) whose greedy completion, up to EOS, is
    exactly the answer. Prompts are batched by token length, so no padding is needed; a batch
    stops decoding once every row has ended (the demo's answers end after 2-4 tokens)."""
    import torch

    from hybridflow.data.chat import encode_chat_prompt

    by_length: dict[int, list[tuple[list[int], str]]] = {}
    for question, answer in problems:
        ids = encode_chat_prompt(tokenizer, user_turn(question))
        by_length.setdefault(len(ids), []).append((ids, answer))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    for group in by_length.values():
        ids = torch.tensor([prompt for prompt, _ in group], device=device)  # [b, P]
        prompt_len = ids.shape[1]
        ended = torch.zeros(len(group), dtype=torch.bool, device=device)  # [b]
        for _ in range(max_new_tokens):
            with torch.no_grad():
                output = model(ids)  # our decoder: logits [b, T, V]; HF: an output object
            next_ids = getattr(output, "logits", output)[:, -1].argmax(-1)  # [b]
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
            ended |= next_ids == tokenizer.eos_token_id
            if bool(ended.all()):
                break
        for row, (_, answer) in zip(ids[:, prompt_len:].tolist(), group):
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            correct += tokenizer.decode(row, skip_special_tokens=True).strip() == answer
    model.train(was_training)
    return correct / max(len(problems), 1)


def tool_accuracy(model, tokenizer, problems, max_turns: int = 2, max_tokens: int = 160) -> float:
    """Fraction of `problems` whose greedy episode with the calculator (the calc task's
    loop) ends with exactly the answer."""
    import asyncio

    from hybridflow.agents.calculator import CalculatorTool
    from hybridflow.agents.client import EngineClient
    from hybridflow.agents.loop import Episode, LoopLimits, ToolCallingLoop, run_episodes
    from hybridflow.engine import Engine, EngineOptions, SamplingParams

    was_training = model.training
    model.eval()
    engine = Engine(model, max_batch_size=len(problems), max_seq_len=256,
                    options=EngineOptions(decode_backend="torch", cuda_graphs=False))  # fmt: skip
    sampling = SamplingParams(temperature=0, stop_token_ids=(tokenizer.eos_token_id,))
    loop = ToolCallingLoop(tokenizer, {"calculator": CalculatorTool()}, sampling,
                           limits=LoopLimits(max_turns=max_turns, max_tokens=max_tokens,
                                             max_tokens_per_turn=max_tokens))  # fmt: skip
    episodes = [Episode(user_turn(question)) for question, _ in problems]
    client = EngineClient(engine)
    trajectories = asyncio.run(run_episodes(loop, episodes, client))
    client.close()
    engine.release()
    model.train(was_training)
    correct = sum(t.final_text.strip() == answer for t, (_, answer) in zip(trajectories, problems))
    return correct / max(len(problems), 1)


class AccuracyStopper:
    """``should_stop(trainer, step)`` for :func:`run_sft`: True once ``evaluate(model)``, run
    every ``sft.eval_every`` steps, reaches ``sft.stop_at_accuracy``; each check is logged,
    and the last and best accuracies kept for the progress line and the final report."""

    def __init__(self, sft_cfg: SFTConfig, evaluate, log=print):
        if sft_cfg.stop_at_accuracy is not None and sft_cfg.eval_every < 1:
            raise ConfigError([f"sft.eval_every = {sft_cfg.eval_every} must be >= 1"])
        self.target, self.every = sft_cfg.stop_at_accuracy, sft_cfg.eval_every
        self.evaluate, self.log = evaluate, log
        self.last: float | None = None
        self.best: float | None = None

    def __call__(self, trainer, step: int) -> bool:
        if self.target is None or step % self.every != 0:
            return False
        self.last = accuracy = self.evaluate(trainer.model)
        self.best = max(accuracy, self.best or 0.0)
        self.log(f"  sft step {step}: greedy accuracy {accuracy:.3f} (target {self.target})")
        if accuracy >= self.target:
            self.log(f"  sft stops at step {step}: accuracy >= {self.target}")
            return True
        return False


def accuracy_stopper(sft_cfg: SFTConfig, evaluate, log=print) -> AccuracyStopper:
    """See :class:`AccuracyStopper`."""
    return AccuracyStopper(sft_cfg, evaluate, log)


def short_of_target(stopper: AccuracyStopper, steps: int) -> str:
    """What to say when the warm start ran to its cap without reaching its accuracy target."""
    return (
        f"warm start: greedy accuracy {stopper.best or 0.0:.3f} at best after {steps} steps "
        f"(sft.total_steps, the cap), short of sft.stop_at_accuracy = {stopper.target}: RL "
        "starts from this model and has less to build on; a larger sft.total_steps trains "
        "longer (a new cache entry, trained from the start)"
    )


def cache_key(cfg: Config, task: str) -> str:
    """Hash of the SFT settings, the data split and the seed (same key = same model)."""
    from hybridflow.workers.model_loading import default_tokenizer_path

    payload = {
        "version": CACHE_VERSION,
        "task": task,
        "sft": dataclasses.asdict(cfg.sft),
        "val_size": cfg.data.builtin_val_size,
        "seed": cfg.trainer.seed,
        "tokenizer": tokenizer_fingerprint(default_tokenizer_path(cfg.model)),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def tokenizer_fingerprint(name_or_path: str) -> list:
    """What the tokenizer makes of a sample conversation: a changed template or vocabulary
    gives a different cache entry instead of a stale model."""
    from hybridflow.data.chat import encode_chat_prompt
    from hybridflow.models import load_tokenizer

    tokenizer = load_tokenizer(name_or_path)
    sample = [{"role": "user", "content": "12+34="}]
    return [name_or_path, encode_chat_prompt(tokenizer, sample), tokenizer.encode("0123456789")]


def planned_model_path(cfg: Config) -> str:
    """The model directory or preset the run starts from, known without training anything:
    for ``sft:<task>`` its cache entry (which :func:`resolve_model_path` trains if missing)."""
    if not cfg.model.path.startswith(SFT_PREFIX):
        return cfg.model.path
    task = cfg.model.path.removeprefix(SFT_PREFIX)
    root = Path(os.path.expanduser(cfg.trainer.cache_dir))
    return str(root / f"sft-{task}-{cache_key(cfg, task)}")


def needs_warm_start(cfg: Config) -> bool:
    """``model.path = sft:<task>`` whose model is not cached yet."""
    planned = planned_model_path(cfg)
    return planned != cfg.model.path and not (Path(planned) / COMPLETE).is_file()


def resolve_model_path(cfg: Config, log=print, progress=None, stop=None) -> str:
    """The model directory or preset to start RL from; trains and caches ``sft:<task>``.
    ``stop``: the run's StopRequest (trainer/lifecycle/stop.py); a signal during the SFT saves its
    progress, which the next run with the same settings continues."""
    if not cfg.model.path.startswith(SFT_PREFIX):
        return cfg.model.path
    from hybridflow.trainer.lifecycle.run_lock import wait_for_turn

    task = cfg.model.path.removeprefix(SFT_PREFIX)
    target = Path(planned_model_path(cfg))
    if (target / COMPLETE).is_file():
        log(f"warm start: cached SFT model {target}")
        return str(target)
    # two runs starting the same warm start (one cache, two examples): one trains it
    with wait_for_turn(target.with_name(target.name + ".lock"), "trains this warm start", log):
        if (target / COMPLETE).is_file():
            log(f"warm start: cached SFT model {target} (trained by the process waited for)")
            return str(target)
        log(f"warm start: SFT of a {cfg.sft.preset} model on builtin:{task} (cached in {target})")
        train_warm_start(cfg, task, target, log, progress, stop)
    return str(target)


def progress_dir(target: Path) -> Path:
    """Where a stopped warm start keeps its progress (an SFT checkpoint) until it finishes."""
    return target.with_name(target.name + ".progress")


def train_warm_start(cfg: Config, task: str, target: Path, log=print, progress=None,
                     stop=None) -> None:  # fmt: skip
    """SFT from scratch on the built-in task; published atomically at ``target``. On a
    stop request, saves its progress after the current SFT step and raises RunStopped."""
    import time

    import torch

    from hybridflow.models import load_model, load_tokenizer
    from hybridflow.progress import quiet_reporter
    from hybridflow.trainer.lifecycle.stop import StopRequest
    from hybridflow.trainer.loop.device import resolve_device
    from hybridflow.trainer.loop.sft_loop import load_sft_examples, run_sft
    from hybridflow.trainer.loop.vision_warm_start import VISION_TASKS, train_vision_warm_start

    if task in VISION_TASKS:  # a vision-language preset on the image task
        return train_vision_warm_start(cfg, task, target, log, progress, stop)
    started = time.perf_counter()
    stop = stop if stop is not None else StopRequest()
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or "char")
    sft_cfg = dataclasses.replace(cfg.sft, train_files=[f"builtin:{task}"])
    examples, _ = load_sft_examples(
        sft_cfg.train_files, tokenizer, sft_cfg, val_size=cfg.data.builtin_val_size
    )
    device = resolve_device(cfg.trainer.device)
    device = "cuda:0" if device == "cuda" else device
    model = load_model(sft_cfg.preset, dtype=torch.float32, device=device)

    def log_progress(metrics: dict[str, Any], step: int) -> None:
        accuracy = "" if reaches_target.last is None else f", accuracy {reaches_target.last:.2f}"
        bar.update(step, status=f"loss {metrics['sft/loss']:.3f}{accuracy}")
        if step % 50 == 0 or step == sft_cfg.total_steps:
            log(f"  sft step {step}/{sft_cfg.total_steps}  loss {metrics['sft/loss']:.3f}")

    problems = accuracy_problems(task, sft_cfg.eval_size, cfg.data.builtin_val_size)
    check = tool_accuracy if task == "calc" else greedy_accuracy
    reaches_target = accuracy_stopper(sft_cfg, lambda lm: check(lm, tokenizer, problems), log)
    reached: list[int] = []

    def should_stop(trainer, step: int) -> bool:
        # checked even when asked to stop: the continued run must stop where this one would
        if reaches_target(trainer, step):
            reached.append(step)
        return bool(reached) or stop.requested

    def save_progress(trainer, sampler, step: int) -> None:
        if stop.requested and not reached:
            saved.save(trainer, sampler, step)

    def resume(trainer, sampler) -> int:
        step = saved.resume(trainer, sampler)
        bar.start_done = bar.done = step  # this run's steps come after it
        return step

    saved = WarmStartProgress(progress_dir(target), cfg, sft_cfg, tokenizer, log)
    progress = progress or quiet_reporter()
    plan = "saving the warm start's progress after this SFT step, then stopping"
    with (
        stop.graceful(plan),
        progress.task(*sft_task(sft_cfg), unit="steps") as bar,
    ):
        trainer = run_sft(
            model,
            examples,
            sft_cfg,
            device=device,
            seed=cfg.trainer.seed,
            pad_token_id=tokenizer.pad_token_id or 0,
            log=log_progress,
            checkpoint=save_progress,
            resume=resume,
            should_stop=should_stop,
        )
        bar.stopped = not reached and trainer.steps_done < sft_cfg.total_steps  # asked to
    if not reached and trainer.steps_done < sft_cfg.total_steps:  # stopped by the request
        raise stop.stopped(
            f"during the warm start SFT at step {trainer.steps_done} of at most "
            f"{sft_cfg.total_steps}: its progress is saved in {saved.root} (nothing else was "
            "written); the same command continues it from there"
        )
    if not reached and sft_cfg.stop_at_accuracy is not None:
        log(short_of_target(reaches_target, trainer.steps_done))
    publish(trainer.model, tokenizer, sft_cfg, target)
    shutil.rmtree(saved.root, ignore_errors=True)
    log(
        f"warm start: SFT done in {time.perf_counter() - started:.0f} s "
        f"({trainer.steps_done} steps)"
    )
    if stop.requested:
        raise stop.stopped(
            f"right after the warm start SFT: its model is cached in {target}; the same "
            "command starts the RL from it"
        )


def sft_task(sft_cfg: SFTConfig) -> tuple[str, int | None]:
    """The warm start's progress description and total: with an accuracy target the step it
    ends at is not known, so the line counts steps against no total (a share of the cap, and
    the time left to reach it, would mislead)."""
    if sft_cfg.stop_at_accuracy is None:
        return "warm start SFT", sft_cfg.total_steps
    return (
        f"warm start SFT to greedy accuracy {sft_cfg.stop_at_accuracy} "
        f"(at most {sft_cfg.total_steps} steps)"
    ), None


class WarmStartProgress:
    """The SFT checkpoint a stopped warm start leaves (``<target>.progress/step_N``), and
    the resume from it: optimizer, schedule, data order and RNG come back, so the finished
    model is the one an uninterrupted SFT makes."""

    def __init__(self, root: Path, cfg: Config, sft_cfg: SFTConfig, tokenizer, log):
        from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager

        self.root, self.tokenizer, self.log = root, tokenizer, log
        self.checkpoints = CheckpointManager(root, keep_last_k=1)
        model = dataclasses.replace(cfg.model, path=sft_cfg.preset)
        self.run_cfg = dataclasses.replace(cfg, model=model, sft=sft_cfg)

    def save(self, trainer, sampler, step: int) -> None:
        from hybridflow.trainer.loop.sft_loop import write_sft_checkpoint

        write_sft_checkpoint(self.checkpoints, trainer, sampler, step, self.run_cfg,
                             self.tokenizer)  # fmt: skip

    def resume(self, trainer, sampler) -> int:
        """The step to continue after (0: none saved)."""
        path = self.checkpoints.latest()
        if path is None:
            return 0
        state = trainer.core.load(path / "actor", trainable_only=False)
        sampler.load_state_dict(state["sampler"])
        self.log(f"warm start: continuing the SFT from step {state['step']}, saved in {path} "
                 "when it was stopped")  # fmt: skip
        return int(state["step"])
