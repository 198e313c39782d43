"""``hybridflow train``: check everything, build the run, resume if asked, train, report.

Order matters for users: the config, every data file and the reward function are checked
before any model is trained or loaded, so a typo costs seconds, not a warm start.
"""

from __future__ import annotations

import dataclasses
import time

from hybridflow.config import Config, validate
from hybridflow.trainer.stages import RunContext

DATA_SEED = 0
"""Seed of the built-in tasks' problems: the validation set is the same whatever trainer.seed."""


def setup(cfg: Config, log=print) -> RunContext:
    """Validate config and data, warm-start if needed, start the workers."""
    from hybridflow.algos import build_kl_controller
    from hybridflow.data.dataset import PromptLoader, build_prompt_datasets
    from hybridflow.models import load_tokenizer
    from hybridflow.rewards import build_reward_manager
    from hybridflow.trainer.checkpoint import CheckpointManager
    from hybridflow.trainer.roles import build_roles, resolve_device
    from hybridflow.trainer.warm_start import resolve_model_path
    from hybridflow.workers.model_loading import default_tokenizer_path, set_cpu_threads

    derived = validate(cfg)
    set_cpu_threads(cfg, resolve_device(cfg.trainer.device))  # SFT and in-process workers
    if cfg.trainer.placement == "split" and cfg.trainer.nnodes > 1:
        raise ValueError("trainer.placement=split runs on one node: set trainer.nnodes=1")
    tokenizer = load_tokenizer(default_tokenizer_path(cfg.model))
    reward = build_reward_manager(cfg.reward, cfg.data.max_response_length)
    try:
        train_set, val_set = build_prompt_datasets(
            cfg.data, tokenizer, seed=DATA_SEED, known_data_sources=reward.known_data_sources()
        )
        log(
            f"data: {len(train_set)} training prompts ({train_set.num_filtered} overlong "
            f"dropped), {len(val_set) if val_set else 0} validation prompts"
        )
        cfg = _with_epochs_as_steps(cfg, len(train_set), log)
        model_path = resolve_model_path(cfg, log=log)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_path))
        roles = build_roles(cfg, derived)
    except BaseException:
        reward.close()
        raise
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    loader = PromptLoader(
        train_set,
        cfg.data.train_batch_size,
        pad,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
    )
    alg = cfg.algorithm
    return RunContext(
        cfg=cfg,
        derived=derived,
        roles=roles,
        tokenizer=tokenizer,
        loader=loader,
        val_dataset=val_set,
        reward=reward,
        kl_ctrl=build_kl_controller(alg.kl_ctrl_type, alg.kl_coef, alg.kl_target, alg.kl_horizon),
        tracker=None,
        checkpoints=CheckpointManager(
            f"{cfg.trainer.run_dir}/checkpoints", cfg.trainer.keep_last_k
        ),
        flops_per_token=_flops_per_token(model_path),
    )


def _with_epochs_as_steps(cfg: Config, num_prompts: int, log) -> Config:
    """``trainer.total_epochs`` turned into ``trainer.total_steps`` now the data is known
    (the sampler drops each epoch's tail shorter than a batch, as verl's loader does)."""
    epochs = cfg.trainer.total_epochs
    if epochs is None:
        return cfg
    steps = epochs * (num_prompts // cfg.data.train_batch_size)
    log(
        f"trainer.total_epochs = {epochs} over {num_prompts} prompts in batches of "
        f"{cfg.data.train_batch_size}: {steps} steps"
    )
    trainer = dataclasses.replace(cfg.trainer, total_steps=steps)
    return dataclasses.replace(cfg, trainer=trainer)


def train(cfg: Config, log=print) -> dict[str, float]:
    """Run RL training; returns the final validation metrics."""
    from hybridflow.trainer.loggers import Tracker
    from hybridflow.trainer.rl_loop import fit
    from hybridflow.trainer.run_state import resume

    started = time.perf_counter()
    run = setup(cfg, log=log)
    try:
        path = resume(run)
        if path is not None:
            log(f"resumed from {path} at step {run.step}")
        t = run.cfg.trainer
        run.tracker = Tracker(
            t.loggers,
            t.run_dir,
            t.total_steps,
            project_name=t.project_name,
            experiment_name=t.experiment_name,
            config=dataclasses.asdict(run.cfg),
            # A fresh run starts a fresh metrics.jsonl (-1 drops every old line).
            resume_step=run.step if path is not None else -1,
        )
        final = fit(run)
    finally:
        if run.tracker is not None:
            run.tracker.close()
        run.roles.shutdown()
        run.reward.close()
    log(summary(run, time.perf_counter() - started))
    return final


def summary(run: RunContext, seconds: float) -> str:
    """Validation accuracy before and after training, per data source."""
    history = run.history.get("val", [])
    lines = [f"done: {run.step} steps in {seconds:.0f} s; metrics in {run.cfg.trainer.run_dir}"]
    if history:
        (first_step, first), (last_step, last) = history[0], history[-1]
        for key in sorted(last):
            before = first.get(key)
            change = "" if before is None else f" ({100 * (last[key] - before):+.1f} points)"
            shown = "n/a" if before is None else f"{before:.3f}"
            lines.append(
                f"  {key}: step {first_step} {shown} -> step {last_step} {last[key]:.3f}{change}"
            )
    return "\n".join(lines)


def _flops_per_token(model_path: str) -> float | None:
    """2 × parameters (+ attention) per token for the MFU estimate; None if unknown."""
    try:
        from hybridflow.models.architecture import ModelArchitecture
        from hybridflow.models.presets import PRESETS

        if model_path in PRESETS:
            mc = PRESETS[model_path]
        else:
            import json
            from pathlib import Path

            mc = ModelArchitecture.from_hf(
                json.loads((Path(model_path) / "config.json").read_text())
            )
        from hybridflow.trainer.metrics import forward_flops_per_token

        hidden, layers = mc.hidden_size, mc.num_hidden_layers
        q = mc.num_attention_heads * mc.head_dim
        kv = mc.num_key_value_heads * mc.head_dim
        per_layer = hidden * (2 * q + 2 * kv) + 3 * hidden * mc.intermediate_size
        params = layers * per_layer + mc.vocab_size * hidden
        return forward_flops_per_token(params, layers, hidden, 0)
    except (OSError, ValueError, KeyError, ImportError):
        return None
