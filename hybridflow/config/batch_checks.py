"""validate()'s batch-size rules: a step's samples split evenly over every role's
data-parallel ranks, into mini-batches and micro-batches (or token budgets) per GPU, for the
actor and a GAE critic, and the sequence lengths that bound them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hybridflow.config.placement_checks import Placement
from hybridflow.config.sections import GROUP_ESTIMATORS, MAX_BUILTIN_PROMPTS, Config
from hybridflow.parallel.roles import sizes_of

Add = Callable[[str], None]


@dataclass(frozen=True)
class BatchSizes:
    """A step's sizes, as validate() derives them."""

    samples: int  # data.train_batch_size × rollout.n
    mini: int  # actor.ppo_mini_batch_size
    mini_per_gpu: int  # actor samples per GPU in a mini-batch (0 if it does not split)
    micro_per_mini: int | None  # micro-batches per mini-batch (None: token budgets)
    critic_mini_per_gpu: int  # critic samples per GPU in a mini-batch (0 without a critic)
    max_len: int  # data.max_prompt_length + data.max_response_length


def check_batch_sizes(cfg: Config, placement: Placement, add: Add) -> BatchSizes:
    """Every batch-size rule, in the order they are reported; -> the sizes."""
    d, r, alg = cfg.data, cfg.rollout, cfg.algorithm
    n = r.n
    if n < 1:
        add(f"rollout.n = {n} must be >= 1")
        n = 1
    if r.max_num_seqs < 1:  # the engine's slots: none would hold a sequence
        add(f"rollout.max_num_seqs = {r.max_num_seqs} must be >= 1 (sequences decoded at once)")
    if alg.adv_estimator in GROUP_ESTIMATORS and r.n == 1:  # below 1 is said just above
        add(
            f"algorithm.adv_estimator = {alg.adv_estimator} normalises within groups of rollout.n samples "
            f"but rollout.n = {r.n}: set rollout.n >= 2 (e.g. 8)"
        )
    if d.train_batch_size < 1:
        add(f"data.train_batch_size = {d.train_batch_size} must be >= 1")
    for key in ("builtin_train_size", "builtin_val_size"):
        if getattr(d, key) > MAX_BUILTIN_PROMPTS:
            add(f"data.{key} = {getattr(d, key)} must be at most {MAX_BUILTIN_PROMPTS:,} (the "
                "prompts a builtin: task makes in memory before the run)")  # fmt: skip
    samples = _check_sample_split(cfg, placement, n, add)
    mini, mini_per_gpu, micro_per_mini = _check_mini_batches(cfg, placement, n, add)
    max_len = _check_lengths(cfg, add)
    critic_mini_per_gpu = 0
    if placement.use_critic:
        critic_mini_per_gpu = _check_critic_batches(cfg, placement, n, mini, add)
    return BatchSizes(samples, mini, mini_per_gpu, micro_per_mini, critic_mini_per_gpu, max_len)


def _check_sample_split(cfg: Config, placement: Placement, n: int, add: Add) -> int:
    """A step's samples split over each role's data-parallel ranks; -> the samples."""
    d, ranks = cfg.data, placement.ranks
    train_dp, rollout_dp = ranks["actor"], ranks["rollout"]
    use_reference, use_critic = placement.use_reference, placement.use_critic
    samples = d.train_batch_size * n
    splits = [(train_dp, "data-parallel ranks")]
    if rollout_dp != train_dp:
        splits.append((rollout_dp, "rollout engines"))
    for role, used in (("ref", use_reference), ("critic", use_critic)):
        if used and ranks[role] not in (train_dp, rollout_dp):
            splits.append((ranks[role], f"{role} data-parallel ranks"))
    for dp, what in splits:
        if dp > 0 and samples % dp:
            need = dp // math.gcd(n, dp)
            add(
                f"data.train_batch_size × rollout.n = {d.train_batch_size} × {n} = {samples} samples cannot be "
                f"split over {dp} {what}: make data.train_batch_size a multiple of {need}"
            )
    return samples


def _check_mini_batches(cfg: Config, placement: Placement, n: int, add: Add):
    """The actor's mini-batches over its ranks and micro-batches per GPU; -> (mini-batch
    size, samples per GPU in a mini-batch, micro-batches per mini-batch or None)."""
    d, a = cfg.data, cfg.actor
    train_dp, train_world = placement.ranks["actor"], placement.train_world
    mini = a.ppo_mini_batch_size
    mini_per_gpu = 0
    if mini < 1 or mini > d.train_batch_size:
        add(
            f"actor.ppo_mini_batch_size = {mini} must be between 1 and data.train_batch_size = "
            f"{d.train_batch_size}"
        )
    else:
        if d.train_batch_size % mini:
            add(
                f"data.train_batch_size = {d.train_batch_size} is not a multiple of actor.ppo_mini_batch_size "
                f"= {mini}: the last mini-batch would be partial; pick a divisor of {d.train_batch_size}"
            )
        if (mini * n) % train_dp:
            need = train_dp // math.gcd(n, train_dp)
            add(
                f"actor.ppo_mini_batch_size × rollout.n = {mini} × {n} = {mini * n} samples cannot be split "
                f"over {train_dp} data-parallel ranks{_dp_arithmetic(cfg, 'actor', train_world)}: "
                f"make actor.ppo_mini_batch_size a multiple of {need}"
            )
        mini_per_gpu = mini * n // max(train_dp, 1)
    micro_per_mini = None
    if a.max_tokens_per_gpu is None:
        mb = a.micro_batch_size_per_gpu
        if mb < 1:
            add(
                f"actor.micro_batch_size_per_gpu = {mb} must be >= 1 (or set actor.max_tokens_per_gpu)"
            )
        elif mini_per_gpu and mini_per_gpu % mb:
            add(
                f"actor mini-batch per GPU = actor.ppo_mini_batch_size × rollout.n / data-parallel ranks = {mini} × {n} / "
                f"{train_dp} = {mini_per_gpu} samples is not a multiple of actor.micro_batch_size_per_gpu = "
                f"{mb}: pick a divisor of {mini_per_gpu}"
            )
        elif mini_per_gpu:
            micro_per_mini = mini_per_gpu // mb
    return mini, mini_per_gpu, micro_per_mini


def _check_lengths(cfg: Config, add: Add) -> int:
    """Token budgets against one full sequence, epochs, the lengths and what an overlong
    prompt does; -> data.max_prompt_length + data.max_response_length."""
    d, a, c = cfg.data, cfg.actor, cfg.critic
    max_len = d.max_prompt_length + d.max_response_length
    if isinstance(a.max_tokens_per_gpu, str) and a.max_tokens_per_gpu != "auto":
        add(f"actor.max_tokens_per_gpu = {a.max_tokens_per_gpu!r} is unknown: use a number of "
            f"tokens (at least {max_len}), auto (the memory plan picks it) or null (batches of "
            f"actor.micro_batch_size_per_gpu samples)")  # fmt: skip
    actor_budget = a.max_tokens_per_gpu if isinstance(a.max_tokens_per_gpu, int) else None
    for key, budget in (
        ("actor.max_tokens_per_gpu", actor_budget),
        ("actor.log_prob_max_tokens_per_gpu", a.log_prob_max_tokens_per_gpu),
        ("ref.max_tokens_per_gpu", cfg.ref.max_tokens_per_gpu),
        ("critic.max_tokens_per_gpu", c.max_tokens_per_gpu),
    ):
        if budget is not None and budget < max_len:
            add(
                f"{key} = {budget} is smaller than one full sequence, data.max_prompt_length + "
                f"data.max_response_length = {d.max_prompt_length} + {d.max_response_length} = {max_len}: "
                f"raise it to at least {max_len} (2-4× that packs better)"
            )
    if a.ppo_epochs < 1:
        add(f"actor.ppo_epochs = {a.ppo_epochs} must be >= 1")
    if d.max_prompt_length < 1 or d.max_response_length < 1:
        add(
            f"data.max_prompt_length = {d.max_prompt_length} and data.max_response_length = "
            f"{d.max_response_length} must both be >= 1"
        )
    if d.overlong_prompts not in ("filter", "error", "truncate"):
        add(
            f"data.overlong_prompts = {d.overlong_prompts!r} is unknown: use filter, error or truncate"
        )
    return max_len


def _check_critic_batches(cfg: Config, placement: Placement, n: int, mini: int, add: Add) -> int:
    """A GAE critic's mini-batches over its ranks; -> its samples per GPU in a mini-batch."""
    d, c = cfg.data, cfg.critic
    critic_mini_per_gpu = 0
    cmini, critic_dp = c.ppo_mini_batch_size or mini, placement.ranks["critic"]
    if cmini < 1 or d.train_batch_size % cmini or (cmini * n) % critic_dp:
        add(
            f"critic.ppo_mini_batch_size = {cmini} must divide data.train_batch_size = {d.train_batch_size} "
            f"and × rollout.n = {n} split evenly over {critic_dp} data-parallel ranks"
            f"{_dp_arithmetic(cfg, 'critic', placement.train_world)}"
        )
    else:
        critic_mini_per_gpu = cmini * n // critic_dp
        if c.max_tokens_per_gpu is None and critic_mini_per_gpu % max(
            c.micro_batch_size_per_gpu, 1
        ):
            add(
                f"critic mini-batch per GPU = {critic_mini_per_gpu} samples is not a multiple of "
                f"critic.micro_batch_size_per_gpu = {c.micro_batch_size_per_gpu}"
            )
    if c.ppo_epochs is not None and c.ppo_epochs < 1:
        add(f"critic.ppo_epochs = {c.ppo_epochs} must be >= 1")
    return critic_mini_per_gpu


def _dp_arithmetic(cfg: Config, role: str, world: int) -> str:
    """`` (devices / (tp × sp) = …)`` when the role's layout is more than data parallel."""
    sizes = sizes_of(cfg, role)
    if sizes["tp"] * sizes["sp"] == 1:
        return ""
    return (f" (its {world} devices / ({role}.tensor_parallel_size × {role}.sequence_parallel_size "
            f"= {sizes['tp']} × {sizes['sp']}))")  # fmt: skip
