"""A run's memory plan from its config, checked against the GPU before any model loads.

``hybridflow train`` and ``hybridflow config validate`` run :func:`check_memory` (through
trainer/lifecycle/preflight.py); ``hybridflow config plan`` prints :func:`plan_for_config`'s table.
The arithmetic and its assumptions are in trainer/plan/memory_plan.py. A plan that does not fit
raises a ConfigError (exit 2) naming the largest items of the phase that overflows and the
changes that would make it fit, each planned again with the change applied.
"""

from __future__ import annotations

import copy
import dataclasses
import math

from hybridflow.config import Config, ConfigError, Derived, apply_mapping, validate
from hybridflow.config.rollout_section import kv_memory_share
from hybridflow.config.sections import UNPLANNED_UPDATE_BUDGET
from hybridflow.parallel.roles import sizes_of
from hybridflow.trainer.plan import memory_choices as choices
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_choices import (
    CheckpointingChoice,
    choose_checkpointing,
    forward_token_budget,
)
from hybridflow.trainer.plan.memory_plan import GIB, MemoryPlan, PlanOptions
from hybridflow.trainer.plan.memory_render import gib, render, usable_bytes
from hybridflow.trainer.plan.memory_reward_model import (
    reward_model_gpu,
    reward_model_gpu_problems,
    reward_model_options,
)
from hybridflow.trainer.plan.memory_vision import image_patches

# model.dtype -> bytes of (trained weights, rollout and reference weights) on a GPU
# (workers/model_loading.training_dtype and resolve_dtype).
DTYPE_BYTES = {"auto": (4, 2), "float32": (4, 4), "bfloat16": (2, 2), "float16": (2, 2)}

LORA_RANK_FIX = 64
"""model.lora_rank suggested for a full fine-tune that does not fit."""


def model_architecture_for(cfg: Config):
    """(name, ModelArchitecture) of the policy without loading it; ``sft:<task>`` plans the
    ``sft.preset`` shape it is trained from. None when the shape is unknown."""
    from hybridflow.models.presets import PRESETS
    from hybridflow.trainer.plan.architecture import model_architecture

    path = cfg.model.path
    if path.startswith("sft:"):
        return (cfg.sft.preset, PRESETS[cfg.sft.preset]) if cfg.sft.preset in PRESETS else None
    architecture = model_architecture(path)
    return None if architecture is None else (path, architecture)


def plan_options(cfg: Config, derived: Derived, gpu_bytes: int | None) -> PlanOptions:
    """What the workers will allocate, read off the config (trainer/plan/memory_plan.py says how
    each option maps onto memory)."""
    m, a, r, t = cfg.model, cfg.actor, cfg.rollout, cfg.trainer
    master_bytes, rollout_bytes = DTYPE_BYTES.get(m.dtype, (4, 2))
    max_len = derived.max_sequence_length
    micro_tokens = a.max_tokens_per_gpu or a.micro_batch_size_per_gpu * max_len
    if a.max_tokens_per_gpu is not None:  # packed: at worst every sample at full length
        micro_batches = math.ceil(derived.mini_batch_samples_per_gpu * max_len / micro_tokens)
    else:
        micro_batches = derived.micro_batches_per_mini_batch or 1
    reference = "none"
    if derived.use_reference:
        reference = "actor" if m.lora_rank > 0 and cfg.ref.path is None else "own"
    critic_tokens = (cfg.critic.max_tokens_per_gpu
                     or cfg.critic.micro_batch_size_per_gpu * max_len)  # fmt: skip
    actor, rollout = sizes_of(cfg, "actor"), sizes_of(cfg, "rollout")
    # a rollout with experts over replicas runs the eager path (engine/backend.resolve_backend);
    # a tensor-parallel one fuses its shard's projections
    unfused = (r.engine.decode_backend == "torch" or r.lora_in_place and m.lora_rank > 0
               or rollout["ep"] > rollout["tp"])  # fmt: skip
    fuse = "none" if unfused else r.engine.fuse_projections
    named = model_architecture_for(cfg)  # a vision-language model: its images' patches
    patches = 0 if named is None else image_patches(named[1], micro_tokens,
                                                    cfg.data.max_prompt_length / max_len)  # fmt: skip
    return PlanOptions(
        master_bytes=master_bytes,
        compute_bytes=2,
        rollout_bytes=rollout_bytes,
        reference_bytes=rollout_bytes,
        lora_rank=m.lora_rank,
        lora_targets=tuple(m.lora_target_modules),
        train_gpus=training_gpus(cfg, derived),
        host_gpus=t.n_gpus_per_node,
        tp=actor["tp"],
        sp=actor["sp"],
        ep=actor["ep"],
        rollout_tp=rollout["tp"],
        rollout_experts_whole=r.expert_parallel_size == 1 and rollout["tp"] > 1,
        rollout_ep=rollout["ep"] if rollout["ep"] > rollout["tp"] else 1,
        rollout_release_weights=r.release_weights,
        param_offload=a.param_offload,
        optimizer_offload=a.optimizer_offload,
        gradient_checkpointing=m.gradient_checkpointing is True,  # auto: plan_for_config
        # model.compile=auto compiles on CUDA (trainer/loop/compile_policy.py)
        compiled_layers=m.compile is True or (m.compile == "auto" and t.device != "cpu"),
        micro_batch_tokens=micro_tokens,
        micro_batches=max(micro_batches, 1),
        rollout_max_seqs=r.max_num_seqs,
        rollout_max_seq_len=max_len,
        kv_block_size=r.engine.kv_block_size,
        cap_state_slots=r.engine.cap_state_slots,
        gpu_memory_utilization=kv_memory_share(r, t),
        # partial rollouts: requests stay in flight while the actor trains, the cache with them
        release_cache=r.release_cache and not (t.mode == "async" and t.partial_rollout),
        fuse_projections=fuse,
        rollout_fp8=r.dtype == "fp8",
        kv_cache_fp8=r.engine.kv_cache_dtype == "fp8",
        max_prefill_tokens=r.engine.max_prefill_tokens,
        split=t.placement == "split",
        rollout_beside_update=t.mode == "async" and (t.max_staleness > 0 or t.partial_rollout),
        lora_in_place=r.lora_in_place,
        reference=reference,
        reference_offload=cfg.ref.param_offload,
        critic=derived.use_critic,
        critic_micro_batch_tokens=critic_tokens,
        **reward_model_options(cfg),
        gpu_bytes=gpu_bytes,
        freeze_vision_tower=a.freeze_vision_tower,
        image_patches=patches,
    )


def training_gpus(cfg: Config, derived: Derived) -> int:
    """The actor's GPUs: all of them, less the rollout's own with split placement."""
    split = cfg.trainer.placement == "split"
    return derived.world_size - (cfg.trainer.rollout_gpus if split else 0)


def plan_for_config(
    cfg: Config, derived: Derived | None = None, gpu_bytes: int | None = None
) -> MemoryPlan | None:
    """The plan of this run on GPUs of ``gpu_bytes`` each; None when the model's shape is
    unknown (an unreadable config.json)."""
    found = model_architecture_for(cfg)
    if found is None:
        return None
    derived = derived or validate(cfg)
    if cfg.actor.max_tokens_per_gpu == "auto":
        cfg = with_changes(cfg, update_budget_changes(cfg, derived, gpu_bytes)[0])
        derived = validate(cfg)
    name, architecture = found
    options = plan_options(cfg, derived, gpu_bytes)
    if cfg.model.gradient_checkpointing == "auto" and gpu_bytes is not None:
        choice = choose_checkpointing(name, architecture, options)
        options = dataclasses.replace(options, gradient_checkpointing=choice.on)
    return mp.build_plan(name, architecture, options)


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


def update_budget_changes(
    cfg: Config, derived: Derived, gpu_bytes: int | None
) -> tuple[dict[str, object], list[str]]:
    """actor.max_tokens_per_gpu=auto resolved, with model.gradient_checkpointing when that is
    auto too (memory_choices.choose_update_budget), and a line saying so on a GPU; ({}, [])
    when the budget is set."""
    m, a = cfg.model, cfg.actor
    if a.max_tokens_per_gpu != "auto":
        return {}, []
    max_len = derived.max_sequence_length
    found = model_architecture_for(cfg)
    if gpu_bytes is None or found is None:
        tokens = max(UNPLANNED_UPDATE_BUDGET, choices.round_up(max_len))
        lines = [] if gpu_bytes is None else [
            f"actor.max_tokens_per_gpu=auto: {tokens:,} tokens (the model's shape is unknown, "
            f"so is its update's memory)"]  # fmt: skip
        return {"actor.max_tokens_per_gpu": tokens}, lines
    name, architecture = found

    def update_bytes(tokens: int, checkpointing: bool) -> int:
        options = plan_options(with_changes(cfg, {"actor.max_tokens_per_gpu": tokens}), derived,
                               gpu_bytes)  # fmt: skip
        options = dataclasses.replace(options, gradient_checkpointing=checkpointing)
        return mp.build_plan(name, architecture, options).phase_bytes(mp.UPDATE)

    batch_tokens = derived.mini_batch_samples_per_gpu * max_len
    choice = choices.choose_update_budget(update_bytes, gpu_bytes, m.gradient_checkpointing,
                                          max_len, batch_tokens)  # fmt: skip
    changes: dict[str, object] = {"actor.max_tokens_per_gpu": choice.tokens}
    if m.gradient_checkpointing == "auto":
        changes["model.gradient_checkpointing"] = choice.checkpointing
    recompute = "with" if choice.checkpointing else "without"
    why = (f"the most, up to {choices.UPDATE_BUDGET_CAP:,}, whose update fits under "
           f"{gib(choice.limit)} {recompute} gradient checkpointing") if choice.fits else (
           f"one sequence; not even its update fits under {gib(choice.limit)}")  # fmt: skip
    auto = "; model.gradient_checkpointing=auto: " + ("on" if choice.checkpointing else "off")
    return changes, [f"actor.max_tokens_per_gpu=auto: {choice.tokens:,} tokens ({why})"
                     f"{auto if m.gradient_checkpointing == 'auto' else ''}"]  # fmt: skip


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
    from hybridflow.trainer.loop.roles import resolve_device

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


# ---------------------------------------------------------------------- not fitting


def fits(plan: MemoryPlan) -> bool:
    usable = usable_bytes(plan.options.gpu_bytes)
    rollout_ok = not plan.options.split or plan.checked_peak(rollout_gpu=True)[1] <= usable
    return plan.kv_slots > 0 and plan.checked_peak()[1] <= usable and rollout_ok


def fit_problems(cfg: Config, plan: MemoryPlan, source: str = "") -> list[str]:
    """One problem naming what overflows and the changes that make it fit; [] when it fits
    (or the GPU size is unknown)."""
    o = plan.options
    if o.gpu_bytes is None or fits(plan):
        return []
    usable = usable_bytes(o.gpu_bytes)
    where = f"a {gib(o.gpu_bytes)} GPU" + (f" ({source})" if source else "")
    head = (f"model.path = {cfg.model.path} does not fit on {where}, {gib(usable)} usable "
            f"after headroom for the CUDA context and fragmentation: ")  # fmt: skip
    phase, peak = plan.checked_peak()
    rollout_gpu = o.split and plan.checked_peak(rollout_gpu=True)[1] > usable
    if rollout_gpu:
        phase, peak = plan.checked_peak(rollout_gpu=True)
    if peak <= usable and plan.kv_slots == 0:
        what = no_kv_slot_text(plan)
    else:
        largest = ", ".join(f"{i.name} {gib(i.gpu_bytes)}"
                            for i in plan.largest(phase, rollout_gpu=rollout_gpu))  # fmt: skip
        what = f"the {phase} needs {gib(peak)} per GPU, most of it {largest}"
    return [f"{head}{what}. {fixes_text(cfg, plan)} (`hybridflow config plan` with the same "
            f"config and overrides prints every item)"]  # fmt: skip


def no_kv_slot_text(plan: MemoryPlan) -> str:
    """Why the engine would refuse its KV cache: the budget holds no slot (slot cache), or
    fewer blocks than one sequence of max_seq_len needs (paged: kv_cache.plan_blocks)."""
    o, length = plan.options, plan.options.rollout_max_seq_len
    one = mp.kv_slot_bytes(plan.architecture, length, o.rollout_bytes)
    what = f"no KV-cache slot of {one / 2**20:.0f} MiB ({length} tokens)"
    if o.kv_block_size is not None:  # a sequence's blocks: its length rounded up to a block
        blocks = -(-length // o.kv_block_size)
        one = blocks * mp.kv_block_bytes(plan.architecture, o.kv_block_size, o.rollout_bytes,
                                         o.kv_cache_fp8)  # fmt: skip
        what = (f"fewer than the {blocks} KV-cache blocks of {o.kv_block_size} tokens "
                f"({one / 2**20:.0f} MiB) that one sequence of {length} tokens needs")  # fmt: skip
    return (f"rollout.gpu_memory_utilization = {o.gpu_memory_utilization} of the memory left "
            f"free during generation, less the engine's reserve of "
            f"{gib(mp.rollout_reserve_bytes(plan.architecture, o))} for logits and prefill, holds "
            f"{what}")  # fmt: skip


def candidate_fixes(cfg: Config, plan: MemoryPlan) -> list[dict[str, object]]:
    """Single changes that lower this run's memory, as {dotted key: value}."""
    m, a, r, o = cfg.model, cfg.actor, cfg.rollout, plan.options
    candidates: list[dict[str, object]] = []
    if m.lora_rank == 0:
        candidates.append({"model.lora_rank": LORA_RANK_FIX})
    if not a.optimizer_offload and not o.sharded:  # FSDP2 offloads with param_offload
        candidates.append({"actor.optimizer_offload": True})
    if o.sharded and not a.param_offload:
        candidates.append({"actor.param_offload": True})
    if m.dtype in ("auto", "float32"):
        candidates.append({"model.dtype": "bfloat16"})
    if not o.gradient_checkpointing:
        candidates.append({"model.gradient_checkpointing": True})
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    budget = a.max_tokens_per_gpu  # "auto" already takes the most that fits
    if isinstance(budget, int) and budget // 2 >= max_len:
        candidates.append({"actor.max_tokens_per_gpu": budget // 2})
    elif a.max_tokens_per_gpu is None and a.micro_batch_size_per_gpu > 1:
        candidates.append({"actor.micro_batch_size_per_gpu": a.micro_batch_size_per_gpu // 2})
    if not r.release_cache:
        candidates.append({"rollout.release_cache": True})
    if not r.release_weights and not mp.rollout_shares_actor_weights(o):
        candidates.append({"rollout.release_weights": True})  # validate: sync, colocated
    if plan.kv_slots == 0:
        if o.gpu_memory_utilization < 0.9:  # auto is 0.9 already where nothing else needs it
            candidates.append({"rollout.gpu_memory_utilization": 0.9})
    elif o.gpu_memory_utilization > 0.1:
        candidates.append(
            {"rollout.gpu_memory_utilization": round(o.gpu_memory_utilization / 2, 2)}
        )
    if o.fuse_projections != "none":
        candidates.append({"rollout.engine.fuse_projections": "none"})
    return candidates


def with_changes(cfg: Config, changes: dict[str, object]) -> Config:
    """A copy of cfg with the dotted keys set."""
    changed = copy.deepcopy(cfg)
    for key, value in changes.items():
        nested: object = value
        for name in reversed(key.split(".")[1:]):
            nested = {name: nested}
        problems = apply_mapping(changed, {key.split(".")[0]: nested}, source="memory plan")
        assert not problems, problems  # the candidates are valid keys and values
    return changed


def replanned(cfg: Config, changes: dict[str, object], gpu_bytes: int) -> MemoryPlan | None:
    """The plan with ``changes`` applied; None if the changed config is not valid."""
    changed = with_changes(cfg, changes)
    try:
        return plan_for_config(changed, validate(changed), gpu_bytes)
    except ConfigError:
        return None


def overrides_text(changes: dict[str, object]) -> str:
    def shown(value):
        return str(value).lower() if isinstance(value, bool) else str(value)

    return " ".join(f"{key}={shown(value)}" for key, value in changes.items())


def fixes_text(cfg: Config, plan: MemoryPlan) -> str:
    """Each change with the peak it gives; if none fits alone, the smallest combination of
    them (greedy, largest saving first) that does, or what is left with all of them."""
    gpu_bytes = plan.options.gpu_bytes
    tried = []
    for changes in candidate_fixes(cfg, plan):
        changed = replanned(cfg, changes, gpu_bytes)
        if changed is not None:
            tried.append((changes, changed))
    tried.sort(key=lambda pair: (not fits(pair[1]), pair[1].checked_peak()[1]))
    helping = [(c, p) for c, p in tried if better(p, plan)]
    alone = [f"{overrides_text(c)} ({peak_text(p)})" for c, p in helping]
    text = "Changes, each planned again: " + "; ".join(alone) if alone else "No single change helps"
    if any(fits(p) for _, p in helping):
        return text + "."
    # A change that does not lower the peak alone may lower the next phase's (the fused
    # decode copies, once the update shrinks): the combination tries them all.
    combined: dict[str, object] = {}
    together = plan
    for changes, _ in tried:
        candidate = replanned(cfg, {**combined, **changes}, gpu_bytes)
        if candidate is None or not better(candidate, together):
            continue
        combined, together = {**combined, **changes}, candidate
        if fits(together):
            combined = fewest_needed(cfg, combined, gpu_bytes)
            together = replanned(cfg, combined, gpu_bytes)
            return f"{text}. Together: {overrides_text(combined)} ({peak_text(together)})."
    phase, _ = together.checked_peak()
    largest = ", ".join(f"{i.name} {gib(i.gpu_bytes)}" for i in together.largest(phase))
    left = f" ({peak_text(together)}: {largest})"
    more = more_gpus_text(cfg, combined, gpu_bytes)
    return f"{text}. Together they do not fit either{left}{more}."


def better(changed: MemoryPlan, plan: MemoryPlan) -> bool:
    """A lower peak, or a KV cache where there was none."""
    lower = changed.checked_peak()[1] < plan.checked_peak()[1]
    return lower or (plan.kv_slots == 0 < changed.kv_slots)


def fewest_needed(cfg: Config, changes: dict[str, object], gpu_bytes: int) -> dict[str, object]:
    """``changes`` (which fit) without each one that the others fit without, last first."""
    kept = dict(changes)
    for key in reversed(list(changes)):
        without = {k: v for k, v in kept.items() if k != key}
        plan = replanned(cfg, without, gpu_bytes) if without else None
        if plan is not None and fits(plan):
            kept = without
    return kept


def more_gpus_text(cfg: Config, changes: dict[str, object], gpu_bytes: int) -> str:
    """The fewest GPUs of this node (FSDP2 shards weights, gradients and AdamW state over
    them) that fit with ``changes``, if 8 or fewer do."""
    if cfg.trainer.nnodes != 1 or cfg.trainer.placement != "colocate":
        return ""
    for gpus in (2, 4, 8):
        if gpus <= cfg.trainer.n_gpus_per_node:
            continue
        sharded = {**changes, "trainer.backend": "local", "trainer.n_gpus_per_node": gpus}
        plan = replanned(cfg, sharded, gpu_bytes)
        if plan is not None and fits(plan):
            sharded = fewest_needed(cfg, sharded, gpu_bytes)
            plan = replanned(cfg, sharded, gpu_bytes)
            return f"; on {gpus} GPUs they do: {overrides_text(sharded)} ({peak_text(plan)})"
    return ""


def peak_text(plan: MemoryPlan) -> str:
    phase, peak = plan.peak()
    too_big = plan.checked_peak()[1] > usable_bytes(plan.options.gpu_bytes)
    no_kv = "no KV-cache slot" if plan.options.kv_block_size is None else "no sequence's KV blocks"
    verdict = "fits" if fits(plan) else "too big" if too_big else no_kv
    return f"peak {gib(peak)} in the {phase}, {verdict}"


def gpu_memory_or_none(cfg: Config) -> tuple[int | None, str]:
    """:func:`gpu_memory`, without importing torch when the config declares the size."""
    if cfg.trainer.gpu_memory_gib is not None or cfg.trainer.device == "cpu":
        return gpu_memory(cfg)
    try:
        return gpu_memory(cfg)
    except ImportError:
        return None, ""
