"""The layout ``hybridflow config plan`` recommends, and why nothing fits when nothing does.

Each candidate is the run's config with the layout keys set, and is judged as ``validate``
and ``train`` judge it: :func:`~hybridflow.config.validate` (a layout whose code path is not
built, such as tensor parallelism of a mixture of experts' experts, is refused there and
never recommended) and the one memory plan
(memory_from_config.plan_for_config, memory_fixes.fits). So a recommended layout passes
``validate`` by construction.

Candidates are every layout with tensor parallelism inside a node (tp ≤ 8), Ulysses sp ≤ 8
and, for a mixture of experts, every expert-parallel size that tiles; the rollout's tp ≤ 8,
its experts split over its tp ranks or, for a mixture of experts, spread over several
replicas (rollout.expert_parallel_size, a multiple of tp dividing the rollout's GPUs and the
experts). The training layout preferred is the one that fits with
the least model parallelism: the smallest tp × sp (the most data parallel; communication
grows with both), then without gradient checkpointing where allowed, then the smaller tp
(Ulysses keeps each layer's weights whole), then the larger ep (fewer experts to gather per
GPU). CPU offload of the training state (actor.param_offload; on one GPU actor.optimizer_offload)
is tried only when no layout fits without it; the rollout's weight copy freed for the update
(rollout.release_weights, sync mode, colocated) only when no layout fits without that, with
the training state on the GPU or on the host; the reference's shard on the host
(ref.param_offload) last (memory_tiers). The rollout's is the smallest tp whose KV cache
holds a whole step's sequences at once on each replica (else the most it can hold), its
experts spread over replicas only when no layout without that holds the step (then the smallest ep).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from hybridflow.config import Config, ConfigError, validate
from hybridflow.models.plan_shapes import PlanShape, shape_of
from hybridflow.parallel.layout import layout_problems
from hybridflow.trainer.plan.memory_plan import MemoryPlan

SIZES = (1, 2, 4, 8)


def shape_allows(s: PlanShape, tp: int, sp: int, ep: int) -> bool:
    """The model's heads, widths, vocabulary and experts divide as validate() requires."""
    local_kv = s.kv_heads // tp if s.kv_heads % tp == 0 else 0
    return (
        s.heads % (tp * sp) == 0
        and local_kv > 0
        and (local_kv % sp == 0 or sp % local_kv == 0)
        and (s.intermediate % tp == 0 or not s.dense_layers)
        and s.moe_intermediate % tp == 0
        and s.vocab % tp == 0
        and (ep == 1 or (s.is_moe and s.experts % ep == 0))
    )


def _expert_sizes(s: PlanShape, limit: int) -> list[int]:
    if not s.is_moe:
        return [1]
    return [ep for ep in range(1, min(limit, s.experts) + 1) if s.experts % ep == 0]


def training_layouts(s: PlanShape, world: int) -> list[tuple[int, int, int]]:
    """(tp, sp, ep) that tile ``world`` and divide the model."""
    return [(tp, sp, ep) for tp in SIZES for sp in SIZES for ep in _expert_sizes(s, world)
            if not layout_problems("train", world, tp, sp, ep)
            and shape_allows(s, tp, sp, ep)]  # fmt: skip


def rollout_layouts(s: PlanShape, world: int) -> list[tuple[int, int | None]]:
    """Rollout (tp, ep): ep None (the experts split over the tp ranks), or for a mixture of
    experts a multiple of tp above it that divides ``world`` and the experts (spread over
    ep / tp replicas, engine/expert_spread.py)."""
    layouts = []
    for tp in rollout_sizes(s, world):
        layouts.append((tp, None))
        if s.is_moe:
            layouts += [(tp, ep) for ep in range(2 * tp, world + 1, tp)
                        if world % ep == 0 and s.experts % ep == 0]  # fmt: skip
    return layouts


def rollout_sizes(s: PlanShape, world: int) -> list[int]:
    """Rollout tp that tile ``world`` and divide the model (its experts over the tp ranks)."""
    return [tp for tp in SIZES
            if not layout_problems("rollout", world, tp, 1, 1) and shape_allows(s, tp, 1, 1)]  # fmt: skip


@dataclass
class Recommendation:
    changes: dict[str, object]
    """The keys that give the recommended layout, as {dotted key: value}; {} when the
    configured layout is the recommended one (or nothing fits)."""
    plan: MemoryPlan | None
    """The recommended layout's plan; None when nothing fits."""
    closest: MemoryPlan | None = None
    """When nothing fits: the candidate that misses by the least."""
    closest_changes: dict[str, object] | None = None


def recommend(cfg: Config, gpu_bytes: int, progress=None) -> Recommendation | None:
    """The preferred layout that fits (module docstring), with the keys to set; None when
    the model's shape is unknown. ``progress`` (a ProgressReporter) is told of each training
    layout tried (about a second of CPU for DeepSeek-V3 on 96 GPUs)."""
    from hybridflow.trainer.plan.memory_from_config import model_architecture_for, training_gpus

    found = model_architecture_for(cfg)
    if found is None:
        return None
    shape, derived = shape_of(found[1]), validate(cfg, planning=True)
    world = training_gpus(cfg, derived)
    rollout_world = derived.world_size - world if cfg.trainer.placement == "split" else world
    setting = cfg.model.gradient_checkpointing
    checkpointing = (False, True) if setting == "auto" else (setting is True,)
    tiers = memory_tiers(cfg, world, derived.use_reference)
    training = sorted(((tier, tp, sp, ep, ckpt) for tier in range(len(tiers))
                       for tp, sp, ep in training_layouts(shape, world) for ckpt in checkpointing),
                      key=lambda c: (c[0], c[1] * c[2], c[4], c[1], -c[3]))  # fmt: skip
    closest: tuple[int, MemoryPlan, dict] | None = None
    with searching(progress, len(training)) as task:
        for tier, tp, sp, ep, ckpt in training:
            if task is not None:
                task.advance()
            candidates = candidate_keys(tiers[tier], tp, sp, ep, ckpt, shape, rollout_world)
            if not candidates or training_refusals(with_keys(cfg, candidates[0]), found[1],
                                                   derived):  # fmt: skip
                continue  # validate refuses every one of them
            fitting, closest = judged(cfg, candidates, gpu_bytes, closest)
            if fitting:
                plan, keys = min(fitting, key=lambda pair: rollout_preference(pair[0], derived))
                return Recommendation(changed_keys(cfg, keys), plan)
    if closest is None:
        return Recommendation({}, None)
    return Recommendation({}, None, closest[1], changed_keys(cfg, closest[2]))


def searching(progress, total: int):
    """The reported task of the search (nullcontext without a reporter); no total, as the
    search ends at the first training layout that fits."""
    if progress is None:
        return contextlib.nullcontext()
    return progress.task("config plan: the layout to recommend",
                         unit=f"of at most {total} training layouts tried")  # fmt: skip


def candidate_keys(memory_keys: dict[str, bool], tp: int, sp: int, ep: int, ckpt: bool,
                   shape: PlanShape, rollout_world: int) -> list[dict[str, object]]:  # fmt: skip
    """The keys of each candidate of one training layout: one a rollout layout."""
    candidates = []
    for rollout_tp, rollout_ep in rollout_layouts(shape, rollout_world):
        keys = {**layout_keys(tp, sp, ep, rollout_tp, ckpt), **memory_keys}
        if rollout_ep is not None:
            keys["rollout.expert_parallel_size"] = rollout_ep
        candidates.append(keys)
    return candidates


def judged(cfg: Config, candidates: list[dict[str, object]], gpu_bytes: int,
           closest: tuple[int, MemoryPlan, dict] | None) -> tuple[list, tuple | None]:  # fmt: skip
    """The candidates (cfg with each one's keys) that validate accepts and that fit, as
    (plan, keys); and the closest miss so far, updated with these (the first of the least
    overflow)."""
    fitting = []
    for keys in candidates:
        plan = plan_of(with_keys(cfg, keys), gpu_bytes)
        if plan is None:
            continue  # validate refuses it: not built, or the batch does not divide
        if fits_plan(plan):
            fitting.append((plan, keys))
        elif closest is None or overflow(plan) < closest[0]:
            closest = (overflow(plan), plan, keys)
    return fitting, closest


def training_refusals(cfg: Config, architecture, derived) -> list[str]:
    """What validate refuses in a candidate's training layout whatever the rollout's (tensor
    parallelism of experts or of LoRA, expert parallelism with the one-device host step:
    config/parallel_checks.py), checked once per training layout before validate judges each
    of its rollout layouts: the rollout's keys do not enter these checks, so a training
    layout they refuse has no candidate validate accepts."""
    from hybridflow.config.parallel_checks import (
        not_built_with_expert_parallel,
        not_built_with_tensor_parallel,
        roles_in_use,
    )
    from hybridflow.parallel.roles import role_sizes

    sizes, in_use = role_sizes(cfg), roles_in_use(derived.use_reference, derived.use_critic)
    return (not_built_with_tensor_parallel(cfg, architecture, sizes, in_use)
            + not_built_with_expert_parallel(cfg, sizes, in_use))  # fmt: skip


def memory_tiers(cfg: Config, world: int, use_reference: bool) -> list[dict[str, bool]]:
    """The keys that save memory at a cost, in the order tried, each only where nothing
    fits without it: the training state on the host (actor.param_offload; on
    one GPU actor.optimizer_offload), then the rollout's copy freed for the update (sync
    mode, colocated; with the state on the GPU first), then the reference's shard on the
    host too (ref.param_offload, FSDP2: a frozen copy of its own). A key the config sets
    true stays true."""
    t = cfg.trainer
    offload_key = "actor.param_offload" if world > 1 else "actor.optimizer_offload"

    def tried(key: str, allowed: bool = True) -> tuple[bool, ...]:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name):
            return (True,)
        return (False, True) if allowed else (False,)

    releases = tried("rollout.release_weights", t.mode == "sync" and t.placement == "colocate")
    own_reference = use_reference and (cfg.model.lora_rank == 0 or cfg.ref.path is not None)
    references = tried("ref.param_offload", own_reference and world > 1)
    return [{"rollout.release_weights": release, offload_key: offload, "ref.param_offload": ref}
            for ref in references for release in releases for offload in tried(offload_key)]  # fmt: skip


def layout_keys(tp: int, sp: int, ep: int, rollout_tp: int,
                checkpointing: bool) -> dict[str, object]:  # fmt: skip
    return {"actor.tensor_parallel_size": tp, "actor.sequence_parallel_size": sp,
            "actor.expert_parallel_size": ep, "rollout.tensor_parallel_size": rollout_tp,
            "model.gradient_checkpointing": checkpointing}  # fmt: skip


def with_keys(cfg: Config, keys: dict[str, object]) -> Config:
    """cfg with a candidate's keys set: new copies of the sections they name, the others
    shared. memory_from_config.with_changes gives the same config through a deep copy and
    the loader's type checks, a few milliseconds a candidate; these keys and values are the
    candidates' own, of the types the sections declare."""
    sections: dict[str, dict[str, object]] = {}
    for key, value in keys.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)
                                       for section, values in sections.items()})  # fmt: skip


def changed_keys(cfg: Config, keys: dict[str, object]) -> dict[str, object]:
    """The keys whose value differs from the config's."""
    changed = {}
    for key, value in keys.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) != value:
            changed[key] = value
    return changed


def plan_of(cfg: Config, gpu_bytes: int) -> MemoryPlan | None:
    """The plan of a candidate config, None when validate refuses it."""
    from hybridflow.trainer.plan.memory_from_config import plan_for_config

    try:
        return plan_for_config(cfg, validate(cfg), gpu_bytes)
    except ConfigError:
        return None


def fits_plan(plan: MemoryPlan) -> bool:
    from hybridflow.trainer.plan.memory_fixes import fits

    return fits(plan)


def rollout_preference(plan: MemoryPlan, derived) -> tuple:
    """A whole step's wave at once on each replica first, then the experts kept inside each
    replica, then the smaller tp and ep, then the most sequences at once over all replicas."""
    o = plan.options
    world = plan.options.train_gpus if not o.split else derived.world_size - o.train_gpus
    replicas = max(world // o.rollout_tp, 1)
    wave = -(-derived.samples_per_step // replicas)
    whole_wave = plan.kv_slots >= min(wave, o.rollout_max_seqs)
    return (not whole_wave, o.rollout_ep > 1, o.rollout_tp, o.rollout_ep,
            -plan.kv_slots * replicas)  # fmt: skip


def overflow(plan: MemoryPlan) -> int:
    """Bytes by which the fullest phase (without the KV cache) exceeds the usable memory."""
    from hybridflow.trainer.plan.memory_render import usable_bytes

    return plan.checked_peak()[1] - usable_bytes(plan.options.gpu_bytes)
