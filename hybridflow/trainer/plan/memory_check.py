"""A run's memory plan from its config, checked against the GPU before any model loads.

``hybridflow train`` and ``hybridflow config validate`` run :func:`check_memory` (through
trainer/lifecycle/preflight.py); ``hybridflow config plan`` prints the table of
memory_from_config.plan_for_config. The arithmetic and its assumptions are in
trainer/plan/memory_plan.py. A plan that does not fit raises a ConfigError (exit 2) naming
the largest items of the phase that overflows and the changes that would make it fit, each
planned again with the change applied (memory_fixes.py).
"""

from __future__ import annotations

import dataclasses

from hybridflow.config import Config, ConfigError, Derived, validate
from hybridflow.trainer.plan import memory_choices as choices
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_choices import (
    CheckpointingChoice,
    choose_checkpointing,
    forward_token_budget,
)
from hybridflow.trainer.plan.memory_fixes import fit_problems
from hybridflow.trainer.plan.memory_from_config import (
    model_architecture_for,
    plan_for_config,
    plan_options,
    update_budget_changes,
    with_changes,
)
from hybridflow.trainer.plan.memory_plan import GIB, MemoryPlan
from hybridflow.trainer.plan.memory_render import gib, render, usable_bytes
from hybridflow.trainer.plan.memory_reward_model import (
    reward_model_gpu,
    reward_model_gpu_problems,
)

# ---------------------------------------------------------------------- choices at run start


def memory_choices(
    cfg: Config, derived: Derived, gpu_bytes: int | None
) -> tuple[dict[str, object], list[str]]:
    """({dotted key: value}, a line for each) resolving model.gradient_checkpointing=auto and
    the log-prob passes' null token budgets (trainer/plan/memory_choices.py says how). Without a
    GPU size or a model shape: checkpointing off and the budgets left null, which makes those
    passes batch like the update: nothing says that more fits, and on the CPU a larger
    micro-batch does not run faster."""
    changes, lines = update_budget_changes(cfg, derived, gpu_bytes)
    if changes:  # the rest is chosen for the budget the update will run with
        cfg = with_changes(cfg, changes)
        derived = validate(cfg)
    m, a = cfg.model, cfg.actor
    found = model_architecture_for(cfg)
    if gpu_bytes is None or found is None:
        if m.gradient_checkpointing == "auto":
            changes["model.gradient_checkpointing"] = False
            if found is None:  # on a GPU (a CPU run has nothing to decide)
                lines.append("model.gradient_checkpointing=auto: off (the model's shape is "
                             "unknown, so is its update's memory)")  # fmt: skip
        return changes, lines
    name, architecture = found
    options = plan_options(cfg, derived, gpu_bytes)
    if m.gradient_checkpointing == "auto":
        choice = choose_checkpointing(name, architecture, options)
        options = dataclasses.replace(options, gradient_checkpointing=choice.on)
        changes["model.gradient_checkpointing"] = choice.on
        lines.append(checkpointing_text(choice))
    keys = ["actor.log_prob_max_tokens_per_gpu"] if a.log_prob_max_tokens_per_gpu is None else []
    if derived.use_reference and cfg.ref.max_tokens_per_gpu is None:
        keys.append("ref.max_tokens_per_gpu")
    if keys:
        plan = mp.build_plan(name, architecture, options)
        batch_tokens = -(-derived.samples_per_step // derived.train_dp_size)
        batch_tokens *= derived.max_sequence_length
        budget = forward_token_budget(plan, options.micro_batch_tokens, batch_tokens)
        changes.update({key: budget for key in keys})
        lines.append(forward_budget_text(plan, keys, budget, options.micro_batch_tokens))
    return changes, lines


def checkpointing_text(choice: CheckpointingChoice) -> str:
    word, share = "on" if choice.on else "off", 1 - choices.CHECKPOINTING_MARGIN
    return (f"model.gradient_checkpointing=auto: {word} (actor update planned at "
            f"{gib(choice.update_without)} without, {gib(choice.update_with)} with; off while "
            f"it stays under {gib(choice.limit)}, {share:.0%} of the usable memory)")  # fmt: skip


def forward_budget_text(plan: MemoryPlan, keys: list[str], budget: int, update: int) -> str:
    a, o = plan.architecture, plan.options
    working = choices.forward_bytes(a, budget, o.compute_bytes)
    resident = choices.forward_resident_bytes(plan)
    return (f"{' and '.join(keys)} = {budget:,} tokens (the update's micro-batch: {update:,}; "
            f"a forward without autograd of that size needs {gib(working)} beside the "
            f"{gib(resident)} resident, {gib(usable_bytes(o.gpu_bytes))} usable)")  # fmt: skip


def memory_defaults(cfg: Config, log, gpu_bytes: int | None = None) -> Config:
    """cfg with :func:`memory_choices` applied, a line each (``gpu_bytes`` None: trainer.
    gpu_memory_gib, else the visible GPU, else unknown)."""
    if gpu_bytes is None:
        gpu_bytes, _ = gpu_memory_or_none(cfg)
    changes, lines = memory_choices(cfg, validate(cfg), gpu_bytes)
    for line in lines:
        log(line)
    return with_changes(cfg, changes) if changes else cfg


def gpu_memory(cfg: Config) -> tuple[int | None, str]:
    """(bytes of one GPU, where the number comes from): ``trainer.gpu_memory_gib`` when set,
    else the first visible GPU (unless trainer.device=cpu), else (None, "")."""
    if cfg.trainer.gpu_memory_gib is not None:
        return int(cfg.trainer.gpu_memory_gib * GIB), "trainer.gpu_memory_gib"
    if cfg.trainer.device == "cpu":
        return None, ""
    import torch

    if not torch.cuda.is_available():
        return None, ""
    properties = torch.cuda.get_device_properties(0)
    return int(properties.total_memory), f"{properties.name}, torch.cuda"


def check_memory(cfg: Config, derived: Derived, log=lambda *a, **k: None) -> MemoryPlan | None:
    """Plan the run's memory when it will run on a GPU (or one is declared), log the table,
    and raise a ConfigError naming the fixes when it cannot fit."""
    gpu_bytes, source = gpu_memory(cfg)
    if gpu_bytes is None:
        return None  # a CPU run: no GPU memory to plan
    plan = plan_for_config(cfg, derived, gpu_bytes)
    if plan is None:
        return None
    from hybridflow.trainer.loop.device import resolve_device

    log(render(plan, source, on_cpu=resolve_device(cfg.trainer.device) == "cpu"))
    reward_gpu = reward_model_gpu(cfg, derived)
    if reward_gpu is not None:
        log(f"  per reward-model GPU: {gib(reward_gpu[0])} (its weights and one forward)")
    problems = fit_problems(cfg, plan, source) or forward_budget_problems(cfg, derived, plan)
    problems = problems or reward_model_gpu_problems(cfg, reward_gpu, gpu_bytes, source)
    if problems:
        raise ConfigError(problems)
    return plan


def forward_budget_problems(cfg: Config, derived: Derived, plan: MemoryPlan) -> list[str]:
    """A problem for each log-prob token budget set in the config whose no-grad forward does
    not fit beside what stays resident (a null budget is chosen by the plan, and fits)."""
    if plan.options.gpu_bytes is None:
        return []
    budgets = {"actor.log_prob_max_tokens_per_gpu": cfg.actor.log_prob_max_tokens_per_gpu}
    if derived.use_reference:
        budgets["ref.max_tokens_per_gpu"] = cfg.ref.max_tokens_per_gpu
    fitting = choices.fitting_forward_tokens(plan)
    a, o = plan.architecture, plan.options
    usable = usable_bytes(o.gpu_bytes)
    resident = choices.forward_resident_bytes(plan)
    return [
        f"{key} = {tokens:,}: a forward without autograd of that many tokens needs "
        f"{gib(choices.forward_bytes(a, tokens, o.compute_bytes))} beside the {gib(resident)} "
        f"resident, {gib(usable)} usable; set it to at most {fitting:,}, or leave it null "
        f"and the plan picks one"
        for key, tokens in budgets.items()
        if tokens is not None and tokens > fitting
    ]  # fmt: skip


def gpu_memory_or_none(cfg: Config) -> tuple[int | None, str]:
    """:func:`gpu_memory`, without importing torch when the config declares the size."""
    if cfg.trainer.gpu_memory_gib is not None or cfg.trainer.device == "cpu":
        return gpu_memory(cfg)
    try:
        return gpu_memory(cfg)
    except ImportError:
        return None, ""
