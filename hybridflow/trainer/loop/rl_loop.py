"""The RL loop (DESIGN.md §1). One step reads like the algorithm:

    generate -> reward -> old log-probs -> ref log-probs -> values -> advantages
             -> critic update -> actor update -> weight sync

(the reward is computed on the controller while the first forward pass runs on its group;
the stage times still add up to the step).

Every stage is one call on a worker group (or cheap controller math) and is timed as
``timing_s/<stage>``. Validation every ``trainer.test_freq`` steps, checkpoints every
``trainer.save_freq`` steps and at the end.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from contextlib import nullcontext

from hybridflow.errors import RunStopped
from hybridflow.protocol import Batch
from hybridflow.trainer.lifecycle.divergence import check_update, kept_checkpoint, non_finite_update
from hybridflow.trainer.lifecycle.run_state import save_checkpoint, start_checkpoint
from hybridflow.trainer.loop.async_rollout import RolloutProducer
from hybridflow.trainer.loop.evaluation import headline, run_validation
from hybridflow.trainer.loop.roles import Roles, sync_weights
from hybridflow.trainer.loop.stages import (
    RunContext,
    balance_ranks,
    collect_rollouts,
    reward_beside_training,
    rewards_and_advantages,
    score,
    stage_scope,
    training_ranks,
)
from hybridflow.trainer.observe.metrics import (
    Timer,
    data_metrics,
    estimate_mfu,
    memory_metrics,
    peak_flops_per_gpu,
    rl_step_flops,
    throughput_metrics,
)
from hybridflow.trainer.observe.rollout_dump import dump_rollouts


def train_step(run: RunContext, rollout: tuple | None = None,
               before_sync: Callable[[], None] | None = None) -> dict[str, float]:  # fmt: skip
    """One RL step on ``data.train_batch_size`` prompts; returns its metrics.

    ``roles.<role>.<method>(…)`` runs that method on the role's worker group; its Protocol
    (trainer/loop/role_handles.py) names the worker and learner code behind it. rollout: the
    step's (batch, metrics) generated ahead (async mode); before_sync: called before the
    weights go to the rollout (async mode waits there for the batches the old ones make)."""
    roles: Roles = run.roles
    timer, metrics = Timer(on_stage=lambda stage: stage_scope(run, stage)), {}
    with timer("step"):
        passes = forward_passes(run)
        beside = bool(passes) and reward_beside_training(run)
        if rollout is None:  # unscored when a pass can run beside the reward
            batch, rollout_metrics = collect_rollouts(run, timer, scored=not beside)
        else:
            batch, rollout_metrics = rollout
        metrics.update(rollout_metrics)
        if run.cfg.rollout.release_weights:  # the passes and the update get its memory
            freed = roles.rollout.release_weights()  # until the sync below rewrites it
            metrics["perf/rollout_weights_released_gb"] = max(freed) / 1024**3
        batch = balance_ranks(batch, training_ranks(run.derived, len(batch)))

        for stage, method in passes:
            if "scores" not in batch.arrays:  # the first pass, in a synchronous step
                batch, reward_metrics = score_beside(run, timer, stage, method, batch)
                metrics.update(reward_metrics)
                continue
            with timer(stage):
                batch = batch.union(method(batch))

        with timer("adv"):
            batch, adv_metrics = rewards_and_advantages(run, batch)
        metrics.update(adv_metrics)
        if run.cfg.trainer.rollout_data_dir is not None:  # verl's dumps of the samples
            dump_rollouts(run.cfg.trainer.rollout_data_dir, run.step, run.tokenizer, batch)

        if roles.critic is not None:
            with timer("update_critic"):
                metrics.update(stop_if_diverged(run, roles.critic.update(batch)[0], "critic"))
        with timer("update_actor"):
            metrics.update(stop_if_diverged(run, roles.actor.update(batch)[0], "actor"))
        with timer("sync_weights"):
            if before_sync is not None:
                before_sync()
            sync_weights(roles, version=run.step)  # the policy after this step's update
    metrics.update(_step_metrics(run, batch, timer))
    return metrics


def stop_if_diverged(run: RunContext, metrics: dict[str, float], role: str) -> dict[str, float]:
    """``metrics`` of the ``role``'s update, or TrainingDiverged when its loss or gradient
    norm was not finite (trainer/lifecycle/divergence.py): raised before this step saves or syncs."""
    if non_finite_update(metrics, role) is None:  # the common case: no directory listing
        return metrics
    checkpoints = run.checkpoints  # None where nothing is saved (the step benchmarks)
    pending = run.pending_save.step if run.pending_save is not None else None
    latest = checkpoints.latest_step() if checkpoints is not None else None
    saved = [step for step in (latest, pending) if step is not None]
    check_update(
        metrics, role, step=f"step {run.step}",
        kept=kept_checkpoint(max(saved, default=None),
                             checkpoints.root if checkpoints is not None else None),
        fix=f"resume from it (trainer.resume=auto) with a lower {role}.lr or "
            f"{role}.grad_clip, and look at the step's samples and rewards "
            f"(trainer.rollout_data_dir=DIR writes them)",
    )  # fmt: skip
    return metrics


def forward_passes(run: RunContext) -> list[tuple[str, Callable[[Batch], Batch]]]:
    """The step's forward passes before the advantages, as (stage, group method): old
    log-probs (unless on-policy), reference log-probs, values."""
    roles: Roles = run.roles
    passes = []
    if not on_policy_shortcut(run):
        passes.append(("old_logprob", roles.actor.compute_logprobs))
    if roles.ref is not None:
        passes.append(("ref", roles.ref.compute_ref_logprobs))
    if roles.critic is not None:
        passes.append(("values", roles.critic.compute_values))
    return passes


def score_beside(run: RunContext, timer: Timer, stage: str, method, batch: Batch):
    """``method(batch)`` on its group while this thread scores the responses: the reward
    (host work: decoding, the reward function) runs beside the pass's device work instead of
    before it. Timed in pieces, so the stages still add up to the step: the reward's time,
    and the pass's beyond it. -> (the scored batch with the pass's columns, the reward's
    metrics)."""
    timeout = method.group.call_timeout_s
    with timer(stage, sync="start"):
        pending = method.remote(batch)
    try:
        with timer("reward", sync="none"):  # a copy: the pass may still read the batch's dicts
            scored, reward_metrics = score(run, batch.select(*batch.keys()))
    except BaseException:
        with contextlib.suppress(Exception):  # the pass ends before the error goes up
            pending.get(timeout=timeout)
        raise
    with timer(stage, sync="end"):
        return scored.union(pending.get(timeout=timeout)), reward_metrics


def on_policy_shortcut(run: RunContext) -> bool:
    """Skip the old-log-prob pass: each RL batch is one optimizer step, so old = sg(current)
    exactly (actor.skip_old_logprob_on_policy). KL in the reward needs old_logprobs first."""
    cfg = run.cfg
    behind = cfg.trainer.mode == "async" and cfg.trainer.max_staleness > 0  # old != behaviour
    return (
        not behind
        and cfg.actor.skip_old_logprob_on_policy
        and cfg.actor.ppo_epochs == 1
        and run.derived.mini_batches_per_step == 1
        and not cfg.algorithm.use_kl_in_reward
    )


def fit(run: RunContext) -> dict[str, float]:
    """Run from ``run.step`` to ``trainer.total_steps``; returns the last validation."""
    t = run.cfg.trainer
    last_val: dict[str, float] = {}
    if run.step == 0 and t.val_before_train:  # nothing trained yet: a signal stops it at once
        last_val = _validate(run)
        if last_val:
            run.tracker.log(last_val, step=0)
    with run.stop.graceful(FINISH_THE_STEP):
        producer = start_producer(run) if t.mode == "async" else None
        try:
            last_val = _steps(run, producer, last_val)
        except BaseException:
            finish_save(run, on_error=run.log)  # the run fails anyway: say what became of it
            raise
        finally:
            if producer is not None:
                producer.close()
        finish_save(run)  # the run's last checkpoint is complete before it returns
        if run.stop.requested and run.step < t.total_steps:
            raise stopped_by_signal(run)
    return last_val


FINISH_THE_STEP = "finishing this step, then saving a checkpoint and stopping"


def start_producer(run: RunContext) -> RolloutProducer:
    """The async mode's rollout thread, from the step after run.step (trainer/loop/async_rollout.py)."""
    t = run.cfg.trainer
    # replacement groups (stale_policy=drop): rounds past those the first attempt may use
    rounds = max(1, run.cfg.algorithm.max_gen_rounds) if run.cfg.algorithm.dynamic_sampling else 1

    def produce(step: int, attempt: int) -> tuple:
        # no device syncs: this thread waits on the rollout's calls, and a sync here would
        # wait for the trainer's kernels too
        timer = Timer(sync_cuda=False)
        batch, metrics = collect_rollouts(run, timer, step=step, first_round=attempt * rounds)
        metrics.update(timer.metrics())  # gen and reward, timed on the producer's thread
        return batch, metrics

    pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    return RolloutProducer(produce, run.step + 1, t.total_steps, t.max_staleness,
                           lambda step: saves_at(t, step), installed=run.step,
                           timeout_s=t.call_timeout_s, partial=t.partial_rollout,
                           stale_policy=t.stale_policy, pad_token_id=pad)  # fmt: skip


def saves_at(t, step: int) -> bool:
    """Whether step `step` ends with a checkpoint (trainer.save_freq; the last step too)."""
    return (t.save_freq > 0 and step % t.save_freq == 0) or (
        step == t.total_steps and t.save_freq >= 0
    )


def _steps(run: RunContext, producer: RolloutProducer | None, last_val: dict) -> dict:
    t = run.cfg.trainer
    while run.step < t.total_steps and not run.stop.requested:
        run.step += 1
        with run.profiler.step(run.step) if run.profiler is not None else nullcontext():
            if producer is None:
                metrics = train_step(run)
            else:
                waited = time.perf_counter()
                batch, rollout_metrics, version = producer.take(run.step)
                waited = time.perf_counter() - waited
                sync_wait = functools.partial(producer.before_install, run.step)
                metrics = train_step(run, (batch, rollout_metrics), before_sync=sync_wait)
                metrics["async/staleness"] = float(run.step - 1 - version)
                metrics["timing_s/wait_rollout"] = waited
        run.progress.set_done(run.step)  # the "training" task opened by trainer/lifecycle/run.py
        is_last = run.step == t.total_steps
        validates = (t.test_freq > 0 and run.step % t.test_freq == 0) or is_last
        if validates and not run.stop.requested:  # asked to stop: save the step instead
            plan = f"ending the validation, then saving the checkpoint of step {run.step}"
            with run.stop.graceful(f"{plan} and stopping"):
                last_val = _validate(run)
            metrics.update(last_val)
        if run.pending_save is not None and run.pending_save.done():
            finish_save(run)  # a failed background write stops the run now, not at the next save
        if saves_at(t, run.step):
            metrics.update(_save(run))
        if producer is not None:  # validated and saved: the next rollouts may use these weights
            producer.installed_version(run.step)
        run.tracker.log(metrics, step=run.step)
    return last_val


def _save(run: RunContext) -> dict[str, float]:
    """Checkpoint this step: written now, or (trainer.async_save) copied to host memory and
    written in the background after the previous background write is complete."""
    with run.progress.task(f"saving checkpoint step_{run.step}"):
        started = time.perf_counter()
        finish_save(run)  # at most one write in flight: the next copy reuses its host memory
        waited = time.perf_counter() - started
        if run.cfg.trainer.async_save:
            run.pending_save = start_checkpoint(run)
        else:
            save_checkpoint(run)
    return {  # two stages, not nested: report plots stack them
        "timing_s/wait_checkpoint": waited,
        "timing_s/save_checkpoint": time.perf_counter() - started - waited,
    }


def finish_save(run: RunContext, on_error: Callable[[str], None] | None = None) -> None:
    """Wait for the background checkpoint, if any. Its failure is raised (CheckpointWriteError,
    naming the directory; the previous complete checkpoint stays the latest), or handed to
    ``on_error`` when another error is already stopping the run."""
    pending, run.pending_save = run.pending_save, None
    if pending is None:
        return
    try:
        pending.wait()
    except Exception as error:
        if on_error is None:
            raise
        on_error(f"the checkpoint of step {pending.step} was not saved: {error}")


def stopped_by_signal(run: RunContext) -> RunStopped:
    """Save the finished step (unless it was just saved) and say how to resume."""
    t = run.cfg.trainer
    resume = f"run the same command again to resume (trainer.resume=auto, run_dir {t.run_dir})"
    latest = run.checkpoints.latest_step()
    if run.step == 0:
        saved, resume = "nothing was trained yet", "the run starts over when run again"
    elif latest == run.step:
        saved = f"the checkpoint of step {run.step} is complete"
    elif t.save_freq < 0:
        saved = "nothing was saved (trainer.save_freq=-1)"
        resume = "the run starts over when run again"
    else:
        try:
            saved = f"saved {save_checkpoint(run)}"
        except Exception as error:  # noqa: BLE001 - say so, and what is still there
            kept = f"step {latest} is the last complete one" if latest else "none is complete"
            saved = f"could not save a checkpoint ({error}); {kept}"
    return run.stop.stopped(f"after step {run.step} of {t.total_steps}: {saved}; {resume}")


def _validate(run: RunContext) -> dict[str, float]:
    started = time.perf_counter()
    metrics = run_validation(run)
    if metrics:
        metrics["timing_s/validation"] = time.perf_counter() - started
        run.history.setdefault("val", []).append((run.step, headline(metrics)))
    return metrics


def _step_metrics(run: RunContext, batch: Batch, timer: Timer) -> dict[str, float]:
    """Entropy, lengths, scores, stage times and throughput of the finished step."""
    metrics: dict[str, float] = {}
    mask = batch.tensors["response_mask"]
    if "entropy" in batch.tensors:
        metrics["actor/entropy"] = float((batch.tensors["entropy"] * mask).sum() / mask.sum())
    metrics.update(data_metrics(batch.tensors, run.cfg.data.max_response_length))
    if run.cfg.trainer.mode == "async":
        metrics.update(async_batch_metrics(batch, trained_version=run.step - 1))
    metrics.update(timer.metrics())
    metrics.update(_perf_metrics(run, batch, timer.seconds["step"]))
    return metrics


def async_batch_metrics(batch: Batch, trained_version: int) -> dict[str, float]:
    """How far behind trained_version the batch's tokens were sampled, and the largest
    importance ratio against the behaviour policy (trainer/loop/staleness.py)."""
    from hybridflow.trainer.loop.staleness import importance_ratio_max, staleness_metrics

    t = batch.tensors
    metrics: dict[str, float] = {}
    if "token_versions" in t:
        metrics.update(staleness_metrics(t["token_versions"], t["response_mask"], trained_version))
    if "old_logprobs" in t and "rollout_logprobs" in t:
        metrics["async/rollout_is_ratio_max"] = importance_ratio_max(
            t["old_logprobs"], t["rollout_logprobs"], t["response_mask"]
        )
    return metrics


def _perf_metrics(run: RunContext, batch: Batch, step_seconds: float) -> dict[str, float]:
    """Tokens/s per device, an MFU estimate (known GPUs only) and memory."""
    n_devices = run.derived.world_size
    num_tokens = int(batch.tensors["attention_mask"].sum())
    metrics = throughput_metrics(num_tokens, step_seconds, n_devices)
    if run.flops_per_token is not None:
        train_passes = run.cfg.actor.ppo_epochs + (run.roles.critic is not None)
        forward_passes = 1 + (run.roles.ref is not None) + (run.roles.critic is not None)
        flops = rl_step_flops(run.flops_per_token, num_tokens, forward_passes, train_passes)
        mfu = estimate_mfu(flops, step_seconds, n_devices, peak_flops_per_gpu())
        if mfu is not None:
            metrics["perf/mfu"] = mfu
    metrics.update(memory_metrics())
    return metrics
