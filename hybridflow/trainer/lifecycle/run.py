"""``hybridflow train``: check everything, build the run, resume if asked, train, report.

Order matters for users: the config, every data file and the reward function are checked
before any model is trained or loaded, so a typo costs seconds, not a warm start.
"""

from __future__ import annotations

import dataclasses
import time

from hybridflow.config import Config
from hybridflow.progress import ProgressReporter, quiet_reporter
from hybridflow.trainer.lifecycle.stop import StopRequest
from hybridflow.trainer.loop.stages import RunContext


def setup(cfg: Config, log=print, progress: ProgressReporter | None = None,
          stop: StopRequest | None = None) -> RunContext:  # fmt: skip
    """Check everything (trainer/lifecycle/preflight.py), warm-start if needed, start the workers.
    ``stop``: what a SIGTERM/SIGINT during the warm start asks (trainer/lifecycle/stop.py)."""
    from hybridflow.algos import build_kl_controller
    from hybridflow.data.dataset import PromptLoader
    from hybridflow.rewards.monitor import FIX_JUDGE, RewardFailureMonitor
    from hybridflow.rewards.parts import score_line, weights_table
    from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager
    from hybridflow.trainer.lifecycle.preflight import prepare_run
    from hybridflow.trainer.lifecycle.run_state import refuse_changed_config
    from hybridflow.trainer.lifecycle.save_policy import save_defaults
    from hybridflow.trainer.loop.compile_policy import compile_defaults
    from hybridflow.trainer.loop.device import resolve_device
    from hybridflow.trainer.loop.roles import build_roles
    from hybridflow.trainer.loop.warm_start import planned_model_path, resolve_model_path
    from hybridflow.trainer.observe.profiling import build_profiler
    from hybridflow.trainer.plan.memory_check import memory_defaults
    from hybridflow.workers.model_loading import idle_cores_line, set_cpu_threads

    progress = progress or quiet_reporter()
    with progress.task("checking the config, data files, model and reward"):
        checked = prepare_run(cfg, log)
    # what a killed save left behind (on a full disk, the rerun needs that space)
    CheckpointManager(f"{cfg.trainer.run_dir}/checkpoints").remove_stale()
    derived, tokenizer, reward = checked.derived, checked.tokenizer, checked.reward
    log(run_layout_line(cfg, derived))
    if (scored_by := score_line(weights_table(cfg.reward))) is not None:
        log(scored_by)  # a reward model or a judge: the score is no longer the rule reward
    cfg = save_defaults(async_defaults(cfg, log), log, critic=derived.use_critic)
    cfg = memory_defaults(cfg, log)  # checkpointing=auto, the log-prob passes' token budgets
    cfg = compile_defaults(cfg, log)  # compile=auto: on when training on CUDA
    train_set, val_set = checked.train_set, checked.val_set
    set_cpu_threads(cfg, resolve_device(cfg.trainer.device))  # SFT and in-process workers
    if (idle := idle_cores_line(cfg, resolve_device(cfg.trainer.device))) is not None:
        log(idle)
    try:
        log(
            f"data: {len(train_set)} training prompts ({train_set.num_filtered} overlong "
            f"dropped), {len(val_set) if val_set else 0} validation prompts"
        )
        cfg = _with_epochs_as_steps(cfg, len(train_set), log)
        # a resume the changed config forbids stops now, not after a warm start's SFT
        planned = dataclasses.replace(cfg.model, path=planned_model_path(cfg))
        refuse_changed_config(dataclasses.replace(cfg, model=planned))
        model_path = resolve_model_path(cfg, log=log, progress=progress, stop=stop)
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
        images=train_set.images,
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
        progress=progress,
        profiler=build_profiler(cfg, roles),
        log=log,
        reward_monitor=RewardFailureMonitor(log, patience=cfg.reward.max_failed_steps),
        reward_weights=weights_table(cfg.reward),
        judge=_judge(cfg, roles, tokenizer),
        judge_monitor=RewardFailureMonitor(
            log,
            patience=cfg.reward.max_failed_steps,
            metric_prefix="reward/judge",
            what="judge",
            fix=FIX_JUDGE,
        ),  # fmt: skip
    )


def run_layout_line(cfg: Config, derived) -> str:
    """Which roles run, and each one's TP/SP/EP/DP sizes over the run's devices."""
    from hybridflow.config.parallel_checks import roles_in_use
    from hybridflow.parallel.roles import layout_line, role_layouts
    from hybridflow.trainer.loop.device import resolve_device

    layouts = derived.layouts or role_layouts(cfg, derived.world_size, derived.world_size)
    in_use = roles_in_use(derived.use_reference, derived.use_critic)
    return layout_line(layouts, in_use, resolve_device(cfg.trainer.device), derived.world_size)


def _judge(cfg: Config, roles, tokenizer):
    """The generative judge of reward.judge (None when off): the policy's rollout group
    answers unless reward.judge.engine=url names a second model's server."""
    if cfg.reward.judge.template is None:
        return None
    from hybridflow.rewards.judge_engines import build_judge

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sampling = {"seed": cfg.trainer.seed, "pad_token_id": pad, "stop_token_ids": stop}
    return build_judge(cfg.reward.judge, roles.rollout, tokenizer, cfg.data.max_prompt_length,
                       sampling)  # fmt: skip


def train(cfg: Config, log=print, progress: ProgressReporter | None = None) -> dict[str, float]:
    """Run RL training; returns the final validation metrics ({} when already finished).
    ``progress``: where progress, the step table and warnings print (default: stdout, bars
    on a terminal)."""
    from hybridflow.trainer.lifecycle.run_lock import hold_run_dir

    with hold_run_dir(cfg.trainer.run_dir, log=log):  # one process per run directory
        finished = finished_message(cfg)
        if finished is not None:
            log(finished)
            return {}
        if progress is None:
            progress = ProgressReporter(interval_s=cfg.trainer.progress_interval_s)
        stop = StopRequest()
        try:
            with stop.on_signals(log), progress.collecting_warnings():
                return _train(cfg, log, progress, stop)
        finally:
            progress.close()


def async_defaults(cfg: Config, log) -> Config:
    """Async mode trains on batches a stale policy sampled, and an fp8 rollout samples from a
    quantized one: truncated importance weights against the behaviour log-probs
    (actor.rollout_is_cap) unless set."""
    t = cfg.trainer
    stale = t.mode == "async" and t.max_staleness > 0
    fp8 = cfg.rollout.dtype == "fp8"
    if not (stale or fp8) or cfg.actor.rollout_is_cap is not None:
        return cfg
    why = "stale" if stale else "fp8"
    log(f"{'async' if stale else 'rollout.dtype=fp8'}: actor.rollout_is_cap=2.0 (truncated "
        f"importance weights against the rollout's {why} policy; set actor.rollout_is_cap to "
        "change it)")  # fmt: skip
    return dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, rollout_is_cap=2.0))


def finished_message(cfg: Config) -> str | None:
    """What to say when run_dir already holds the checkpoint of trainer.total_steps."""
    from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager

    t = cfg.trainer
    if t.resume != "auto":
        return None
    latest = CheckpointManager(f"{t.run_dir}/checkpoints").latest_step()
    if latest is None or latest < t.total_steps:
        return None
    return (
        f"nothing to do: {t.run_dir} already holds the checkpoint of step {latest} and "
        f"trainer.total_steps = {t.total_steps}. To train further, raise it (e.g. "
        f"trainer.total_steps={latest + t.total_steps}: it resumes from step {latest}); to "
        f"start over, use another trainer.run_dir or trainer.resume=disable; "
        f"`hybridflow export {t.run_dir}/checkpoints/step_{latest} OUT` writes the model"
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


def _train(cfg: Config, log, progress: ProgressReporter, stop) -> dict[str, float]:
    from hybridflow.trainer.lifecycle.run_state import resume
    from hybridflow.trainer.loop.device import resolve_device
    from hybridflow.trainer.loop.rl_loop import fit
    from hybridflow.trainer.observe.loggers import Tracker

    started = time.perf_counter()
    run = setup(cfg, log=log, progress=progress, stop=stop)
    run.stop = stop
    stop.reclaim()  # starting the workers may have installed another SIGTERM handler (Ray)
    try:
        write_run_config(run.cfg)
        with progress.task("resuming: loading the latest checkpoint"):
            path = resume(run, log=log)
        resumed_at = run.step
        if path is not None:
            log(f"resumed from {path} at step {run.step}")
        t = run.cfg.trainer
        run.tracker = Tracker(
            t.loggers,
            t.run_dir,
            project_name=t.project_name,
            experiment_name=t.experiment_name,
            config=dataclasses.asdict(run.cfg),
            # A fresh run starts a fresh metrics.jsonl (-1 drops every old line).
            resume_step=run.step if path is not None else -1,
            progress=progress,
            device=resolve_device(t.device),
        )
        with progress.task("training", total=t.total_steps, unit="steps", done=run.step, rows=True):
            final = fit(run)
    finally:
        if run.tracker is not None:
            run.tracker.close()
        run.roles.shutdown()
        run.reward.close()
    log(summary(run, time.perf_counter() - started, resumed_at))
    if run.profiler is not None and run.profiler.summary():
        log(run.profiler.summary())
    return final


RUN_CONFIG = "config.yaml"
"""The resolved config of a run, beside its metrics.jsonl (``hybridflow report`` shows it)."""


def write_run_config(cfg: Config) -> None:
    """``<run_dir>/config.yaml``, written atomically (a report may read it at any time)."""
    import os
    from pathlib import Path

    import yaml

    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    temporary = run_dir / f"{RUN_CONFIG}.tmp{os.getpid()}"
    temporary.write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    os.replace(temporary, run_dir / RUN_CONFIG)


def summary(run: RunContext, seconds: float, resumed_at: int = 0) -> str:
    """The steps this run trained (after ``resumed_at``, the checkpoint it resumed from), then
    validation before and after training, per data source (only the values, when validation
    ran once: there is no gain to show). The rule reward's change is in points (it scores right
    or wrong); a score made by a reward model or a judge is named, and its change is a number."""
    from hybridflow.rewards.combine import ANY_SOURCE
    from hybridflow.rewards.parts import describe_weights, rule_reward_alone

    history = run.history.get("val", [])
    steps = f"{run.step - resumed_at} steps in {seconds:.0f} s"
    if resumed_at:
        steps += (f" (steps {resumed_at + 1} to {run.step} of {run.cfg.trainer.total_steps}, "
                  f"resumed from the checkpoint of step {resumed_at})")  # fmt: skip
    lines = [f"done: {steps}; metrics in {run.cfg.trainer.run_dir}"]
    accuracy = rule_reward_alone(run.reward_weights)
    if history and not accuracy:
        lines.append(f"  validation score: {describe_weights(run.reward_weights[ANY_SOURCE])}, "
                     "not an accuracy (val/reward/<part>/mean: each part's own mean)")  # fmt: skip
    if len(history) == 1:
        step, values = history[0]
        lines.append(f"  validation ran once, at step {step}, so there is no gain to show:")
        lines += [f"  {key}: {values[key]:.3f}" for key in sorted(values)]
    elif history:
        (first_step, first), (last_step, last) = history[0], history[-1]
        for key in sorted(last):
            before = first.get(key)
            change = (
                "" if before is None
                else f" ({100 * (last[key] - before):+.1f} points)" if accuracy
                else f" ({last[key] - before:+.3f})"
            )  # fmt: skip
            shown = "n/a" if before is None else f"{before:.3f}"
            lines.append(
                f"  {key}: step {first_step} {shown} -> step {last_step} {last[key]:.3f}{change}"
            )
    return "\n".join(lines)


def _flops_per_token(model_path: str) -> float | None:
    """2 × parameters (+ attention) per token for the MFU estimate; None if unknown."""
    from hybridflow.trainer.lifecycle.preflight import model_architecture, parameter_count
    from hybridflow.trainer.observe.metrics import forward_flops_per_token

    architecture = model_architecture(model_path)
    if architecture is None:
        return None
    return forward_flops_per_token(
        parameter_count(architecture),
        architecture.num_hidden_layers,
        architecture.hidden_size,
        0,
    )
