"""The stages of one RL step that need more than one line in the loop.

Each takes the run's context and a Batch and returns a new Batch (plus metrics). The
controller never touches a model: generation and every forward pass are worker calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow.config import Config, Derived
from hybridflow.data.image_batch import (
    IMAGE_GRID_THW,
    MROPE_POSITIONS,
    PIXEL_VALUES,
    extend_positions,
)
from hybridflow.engine.scheduling.tail import TAIL_METRICS
from hybridflow.engine.speculative import SPECULATIVE_METRICS
from hybridflow.progress import ProgressReporter, quiet_reporter
from hybridflow.protocol import Batch
from hybridflow.trainer.lifecycle.stop import StopRequest
from hybridflow.trainer.loop.roles import Roles
from hybridflow.trainer.observe.metrics import Timer

if TYPE_CHECKING:
    from hybridflow.algos.kl import AdaptiveKLController, FixedKLController
    from hybridflow.data.dataset import PromptDataset, PromptLoader
    from hybridflow.rewards.judge import JudgeReward
    from hybridflow.rewards.managers import RewardManager
    from hybridflow.rewards.monitor import RewardFailureMonitor
    from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager
    from hybridflow.trainer.lifecycle.pending_save import PendingSave
    from hybridflow.trainer.observe.loggers import Tracker
    from hybridflow.trainer.observe.profiling import StepProfiler

PROMPT_MASK = "prompt_mask"
SCORED_FOR = "scored_for"
"""``batch.meta`` key: what a scored batch is for (training, validation, baseline)."""


@dataclass
class RunContext:
    """Everything the loop needs, built by ``trainer.run.setup``."""

    cfg: Config
    derived: Derived
    roles: Roles
    """The worker groups' handles (trainer/loop/role_handles.py says what each call runs)."""
    tokenizer: Any
    """An HF tokenizer, or the built-in character tokenizer (models/tokenizer.py)."""
    loader: PromptLoader
    """``next_batch()``: the next ``data.train_batch_size`` training prompts (the GRPO
    benchmark passes fixed prompts with the same method, bench/grpo_steps.py)."""
    val_dataset: PromptDataset | None
    reward: RewardManager
    """``score(texts, ground_truths, …)`` (the GRPO benchmark passes random scores)."""
    kl_ctrl: FixedKLController | AdaptiveKLController
    tracker: Tracker | None
    checkpoints: CheckpointManager
    step: int = 0
    flops_per_token: float | None = None
    history: dict[str, list] = field(default_factory=dict)
    """Validation results by step, for the before/after summary."""
    progress: ProgressReporter = field(default_factory=quiet_reporter)
    """Where long phases report how far they are (hybridflow/progress.py)."""
    profiler: StepProfiler | None = None
    """Profiles the steps of ``trainer.profile.steps`` (trainer/observe/profiling.py); None: off."""
    stop: StopRequest = field(default_factory=StopRequest)
    """Set by SIGTERM/SIGINT: the loop saves after the current step and stops (trainer/lifecycle/stop.py)."""
    log: Callable[[str], None] = print
    """Progress and warning lines (reward failures, the stop message)."""
    reward_monitor: RewardFailureMonitor | None = None
    """Prints reward errors once each, stops a run whose reward always fails."""
    reward_weights: dict[str, dict[str, float]] = field(
        default_factory=lambda: {"*": {"rule": 1.0}}
    )
    """{data source or "*": {part: weight}}: how the reward parts combine
    (rewards/combine.py)."""
    judge: JudgeReward | None = None
    """The generative judge (reward.judge), if on."""
    judge_monitor: RewardFailureMonitor | None = None
    """As reward_monitor, for the judge's failures."""
    pending_save: PendingSave | None = None
    """The checkpoint being written in the background (trainer.async_save), if any."""


@contextmanager
def stage_scope(run: RunContext, stage: str) -> Iterator[None]:
    """Around each timed stage: the progress status names it, a profile gets its range."""
    if stage != "step":
        run.progress.set_status(stage)
    with run.profiler.stage(stage) if run.profiler is not None else nullcontext():
        yield


def sampling_meta(run: RunContext, *, n: int, temperature: float, seed: int) -> dict[str, Any]:
    """What the rollout workers read from ``batch.meta``."""
    tokenizer = run.tokenizer
    # The tokenizer's end of turn may differ from the model config's eos (chat models).
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if run.cfg.rollout.ignore_eos:  # benchmarks: always max_response_length tokens
        stop = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return {
        "n": n,
        "temperature": temperature,
        "seed": seed,
        "pad_token_id": pad,
        "stop_token_ids": stop,
    }


def rollout_request(prompts: Batch, n: int, engine_n: int) -> Batch:
    """The rows a generate call sends: each prompt once (the engine makes its ``engine_n``
    = n samples) or n times (``engine_n`` = 1), with ``sample_index`` [rows], each row's
    first sample in the whole call (prompt i's sample j is i * n + j). The seeds follow it,
    not the rank a row lands on, so any split over processes draws the same tokens."""
    request = prompts if engine_n == n else prompts.repeat(n, interleave=True)
    request.tensors["sample_index"] = torch.arange(len(request)) * engine_n  # [rows]
    return request


def generate(run: RunContext, prompts: Batch, *, n: int, temperature: float, seed: int) -> Batch:
    """``n`` samples of each prompt row; returns the prompt rows repeated (interleaved) with
    ``responses``, ``response_mask``, ``rollout_logprobs`` and the full ``attention_mask``
    [B*n, P+R] (``prompt_mask`` [B*n, P] keeps the prompt part)."""
    prompts = Batch(prompts.tensors, prompts.arrays, dict(prompts.meta))
    # The engine prefills a prompt once for its n samples. When the rows do not divide over
    # the rollout ranks, DP_SPLIT must pad, which needs one output row per input row.
    engine_n = n if len(prompts) % run.roles.rollout_dp == 0 else 1
    agent = run.cfg.rollout.agent.loop is not None
    keys = ("prompts", "attention_mask", "raw_prompt") if agent else ("prompts", "attention_mask")
    if run.cfg.rollout.agent.loop == "openai" and "extra_info" in prompts.arrays:
        keys += ("extra_info",)  # an agent program reads its row's extra_info
    if PIXEL_VALUES in prompts.arrays:  # prompts with images (data/image_batch.py)
        keys += (PIXEL_VALUES, IMAGE_GRID_THW, MROPE_POSITIONS)
    request = rollout_request(prompts.select(*keys, meta=False), n, engine_n)
    request.meta.update(sampling_meta(run, n=engine_n, temperature=temperature, seed=seed))
    if run.cfg.trainer.partial_rollout:  # the weight syncs reach the worker meanwhile
        from hybridflow.trainer.loop.async_rollout import generate_across_updates

        out = generate_across_updates(run.roles.rollout, request, run.roles.rollout_dp,
                                      run.cfg.trainer.call_timeout_s)  # fmt: skip
    else:
        out = run.roles.rollout.generate(request)
    rows = prompts.repeat(n, interleave=True)
    prompt_mask = rows.tensors.pop("attention_mask")
    if "agent_prompts" in out.tensors:  # episodes render their own prompt (with the tools)
        rows.tensors["prompts"] = out.tensors.pop("agent_prompts")
        prompt_mask = out.tensors.pop("agent_prompt_mask")
    if "agent_mrope_positions" in out.tensors:  # and with images, its mRoPE rows
        rows.tensors[MROPE_POSITIONS] = out.tensors.pop("agent_mrope_positions")
    # the tokens the policy reads: all real ones (tool output too); the loss: response_mask
    response_attention = out.tensors.pop("response_attention_mask", None)
    rows = rows.union(out)
    if response_attention is None:
        response_attention = rows.tensors["response_mask"]
    rows.tensors[PROMPT_MASK] = prompt_mask
    rows.tensors["attention_mask"] = torch.cat(
        [prompt_mask.long(), response_attention.long()], dim=1
    )  # [B*n, P+R]
    if MROPE_POSITIONS in rows.tensors:  # the responses' rows, after their prompt's largest
        rows.tensors[MROPE_POSITIONS] = extend_positions(rows.tensors[MROPE_POSITIONS],
                                                         response_attention)  # fmt: skip
    rows.meta["temperature"] = temperature
    return rows


def score(run: RunContext, batch: Batch, step: int | None = None) -> tuple[Batch, dict[str, float]]:
    """Decode the responses, score them with each reward part (rule, model, judge), combine the
    parts with the data sources' weights, put each score on its last response token
    (``token_level_scores`` [B, R]); ``scores`` [B] kept as an array.
    Failures are reported by ``run.reward_monitor``; those of training samples (not
    ``batch.meta[SCORED_FOR]`` = validation / baseline) count towards stopping a run whose
    reward always fails."""
    from hybridflow.rewards.combine import combine_parts, used_parts
    from hybridflow.rewards.placement import decode_responses, place_scores

    response_mask = batch.tensors["response_mask"]
    if "final_text" in batch.arrays:  # agent episodes: the model's last message is scored
        texts = [str(text) for text in batch.arrays["final_text"]]
    else:
        texts = decode_responses(run.tokenizer, batch.tensors["responses"], response_mask)
    batch.arrays["response_text"] = np.asarray(texts, dtype=object)
    data_sources = [str(source) for source in batch.arrays["data_source"]]
    used, parts, metrics = used_parts(run.reward_weights), {}, {}
    if "rule" in used:
        result = run.reward.score(
            texts,
            list(batch.arrays["ground_truth"]),
            data_sources,
            list(batch.arrays["extra_info"]),
            response_lengths=response_mask.sum(-1).long().tolist(),
        )
        if run.reward_monitor is not None:
            training = batch.meta.get(SCORED_FOR, "training") == "training"
            run.reward_monitor.observe(result, run.step if step is None else step,
                                       training=training)  # fmt: skip
        parts["rule"], metrics = result.scores, dict(result.metrics)
    if "model" in used:
        scored = run.roles.reward_model.compute_rm_scores(
            batch.select(
                "prompts", "responses", "attention_mask", "raw_prompt", "response_text", meta=False
            )  # fmt: skip
        )
        parts["model"] = scored.tensors["rm_scores"].tolist()
    if "judge" in used:
        judged = run.judge.score(list(batch.arrays["raw_prompt"]), texts,
                                 list(batch.arrays["ground_truth"]))  # fmt: skip
        if run.judge_monitor is not None:
            training = batch.meta.get(SCORED_FOR, "training") == "training"
            run.judge_monitor.observe(judged, run.step if step is None else step,
                                      training=training)  # fmt: skip
        parts["judge"] = judged.scores
        metrics.update(judged.metrics)
    scores, part_metrics = combine_parts(parts, data_sources, run.reward_weights)
    if set(parts) != {"rule"}:  # the rule reward alone: its metrics say it all
        metrics.update(part_metrics)
    batch.tensors["token_level_scores"] = place_scores(scores, response_mask)
    batch.arrays["scores"] = np.asarray(scores, dtype=np.float64)
    if "agent_turns" in batch.arrays:
        from hybridflow.agents.rollout import agent_metrics

        metrics.update(agent_metrics(batch.arrays))
    metrics.update(batch.meta.get(SPECULATIVE_METRICS, {}))  # rollout.engine.speculative
    metrics.update(batch.meta.get(TAIL_METRICS, {}))  # the long tail's seconds (and saved)
    return batch, metrics


def reward_beside_training(run: RunContext) -> bool:
    """Whether scoring leaves the training group free, so that it may run beside a forward
    pass there: the rule reward is host work, a reward model on devices of its own
    (reward.model.n_gpus_per_node) is another group, and so is a judge behind a server or
    the rollout group of a split placement."""
    from hybridflow.rewards.combine import used_parts

    apart = {"rule"}
    if run.roles.reward_model_apart:
        apart.add("model")
    if run.cfg.reward.judge.engine == "url" or run.roles.split:
        apart.add("judge")
    return used_parts(run.reward_weights) <= apart


def step_seed(run: RunContext, round_index: int = 0, salt: int = 0,
              step: int | None = None) -> int:  # fmt: skip
    """Sampling seed of a generation call: a function of (trainer.seed, step, round), so a
    resumed run draws exactly the samples the uninterrupted run drew. step: the RL step the
    rollout is for (default run.step; the async producer works ahead of it)."""
    step = run.step if step is None else step
    return (run.cfg.trainer.seed * 1_000_003 + step * 1_009 + round_index * 31 + salt) % 2**62


def next_prompts(run: RunContext, round_index: int, step: int | None = None) -> Batch:
    step = run.step if step is None else step
    prompts = run.loader.next_batch()
    prompts.arrays["uid"] = np.asarray(
        [f"{step}.{round_index}.{i}" for i in range(len(prompts))], dtype=object
    )
    return prompts


def collect_rollouts(run: RunContext, timer: Timer, step: int | None = None,
                     first_round: int = 0, scored: bool = True) -> tuple[Batch, dict[str, float]]:  # fmt: skip
    """Generate and score ``data.train_batch_size`` groups of ``rollout.n`` samples.

    DAPO dynamic sampling keeps only groups whose scores differ and draws more prompts
    (up to ``algorithm.max_gen_rounds`` rounds) until the batch is full; if it is still
    short, groups without signal fill it (zero advantage) and the shortfall is reported.
    ReMax adds ``reward_baselines`` [B]: the score of a greedy answer to each prompt.
    step: the RL step the rollout is for (default run.step). first_round: the index of the
    first round (uids and seeds; the async mode's replacement groups start further on).
    scored=False: the responses are left unscored for the caller to score (``score``) beside
    the next device work; dynamic sampling scores anyway, to choose its groups.
    """
    cfg = run.cfg
    alg, n = cfg.algorithm, cfg.rollout.n
    want = cfg.data.train_batch_size
    kept: list[Batch] = []
    spare: list[Batch] = []
    metrics: dict[str, float] = {}
    rounds = 0
    while True:
        round_index = first_round + rounds
        prompts = next_prompts(run, round_index, step)
        seed = step_seed(run, round_index, step=step)
        with timer("gen"):
            batch = generate(run, prompts, n=n, temperature=cfg.rollout.temperature, seed=seed)
        if alg.adv_estimator == "remax":
            with timer("gen_baseline"):
                batch.tensors["reward_baselines"] = greedy_baseline(run, prompts, round_index,
                                                                    step)  # fmt: skip
        if not (scored or alg.dynamic_sampling):
            return batch, metrics
        with timer("reward", sync="none"):  # host work
            batch, reward_metrics = score(run, batch, step)
        metrics.update(reward_metrics)
        rounds += 1
        if not alg.dynamic_sampling:
            return batch, metrics
        from hybridflow.algos import groups_with_signal

        signal = groups_with_signal(batch.arrays["scores"], batch.arrays["uid"]).numpy()
        kept.append(batch.index(np.flatnonzero(signal)))
        spare.append(batch.index(np.flatnonzero(~signal)))
        have = sum(len(b) for b in kept) // n
        if have >= want or rounds >= alg.max_gen_rounds:
            break
    batch = Batch.concat(kept + spare).index(slice(0, want * n))
    metrics["dynamic_sampling/gen_rounds"] = float(rounds)
    metrics["dynamic_sampling/groups_with_signal"] = float(have)
    metrics["dynamic_sampling/filled_groups"] = float(max(want - have, 0))
    return batch, metrics


def greedy_baseline(run: RunContext, prompts: Batch, round_index: int,
                    step: int | None = None) -> torch.Tensor:  # fmt: skip
    """ReMax baseline: the score of one greedy response per prompt, repeated ``n`` times."""
    seed = step_seed(run, round_index, 7, step=step)
    greedy = generate(run, prompts, n=1, temperature=0.0, seed=seed)
    greedy.meta[SCORED_FOR] = "baseline"
    greedy, _ = score(run, greedy, step)
    baseline = torch.as_tensor(greedy.arrays["scores"], dtype=torch.float32)  # [B]
    return baseline.repeat_interleave(run.cfg.rollout.n)  # [B*n]


def rewards_and_advantages(run: RunContext, batch: Batch) -> tuple[Batch, dict[str, float]]:
    """``token_level_rewards`` (scores, minus β·KL when KL is in the reward), then the
    configured advantage estimator's ``advantages`` and ``returns`` (all [B, R])."""
    from hybridflow.algos import apply_kl_in_reward, compute_advantage

    cfg, t = run.cfg.algorithm, batch.tensors
    metrics: dict[str, float] = {}
    rewards = t["token_level_scores"]
    if cfg.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_in_reward(
            rewards,
            t["old_logprobs"],
            t["ref_logprobs"],
            t["response_mask"],
            run.kl_ctrl,
            kind=cfg.kl_penalty,
        )
        metrics.update(kl_metrics)
    t["token_level_rewards"] = rewards
    t["advantages"], t["returns"] = compute_advantage(
        cfg.adv_estimator,
        token_level_rewards=rewards,
        response_mask=t["response_mask"],
        index=batch.arrays["uid"],
        values=t.get("values"),
        gamma=cfg.gamma,
        lam=cfg.lam,
        norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo,
        reward_baselines=t.get("reward_baselines"),
    )
    return batch, metrics


def training_ranks(derived: Derived, samples: int) -> int:
    """Over how many chunks to balance a step's samples: every training rank, since the
    controller splits the batch over all of them whatever the layout, and a tensor- or
    sequence-parallel replica then works on its ranks' chunks taken together; balanced the
    same way as data parallelism over those ranks, it gets the same mini-batches. The
    data-parallel ranks when the samples do not divide over every rank."""
    layouts = derived.layouts
    world = layouts.actor.world if layouts is not None else derived.train_dp_size
    return world if samples % world == 0 else derived.train_dp_size


def balance_ranks(batch: Batch, dp_size: int) -> Batch:
    """Reorder rows so each data-parallel rank's contiguous chunk carries about the same number
    of tokens (Karmarkar–Karp on sequence lengths); one rank never waits for a longer one."""
    if dp_size <= 1:
        return batch
    from hybridflow.learners import balanced_dp_order

    lengths = batch.tensors["attention_mask"].sum(-1).tolist()
    return batch.index(balanced_dp_order(lengths, dp_size))
