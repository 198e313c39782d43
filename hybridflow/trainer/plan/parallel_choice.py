"""The layout the parallel plan recommends, and why nothing fits when nothing does.

Candidates are every valid layout with tensor parallelism inside a node (tp ≤ 8), Ulysses
sp ≤ 8 and, for a mixture of experts, every expert-parallel size that tiles; the rollout's
tp ≤ 8 (and its ep). The training layout preferred is the one that fits with the least model
parallelism: the smallest tp × sp (the most data parallel; communication grows with both),
then without gradient checkpointing where allowed, then the smaller tp (Ulysses keeps each
layer's weights whole), then the larger ep (fewer experts to gather per GPU). CPU offload of
the training state (actor.param_offload) is tried only when no layout fits without it. The
rollout's is the smallest tp whose KV cache holds a whole step's sequences at once on each
replica (else the most it can hold).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridflow.models.plan_shapes import PlanShape
from hybridflow.parallel.layout import layout_problems
from hybridflow.trainer.plan.memory_plan import GENERATE
from hybridflow.trainer.plan.memory_render import gib, usable_bytes
from hybridflow.trainer.plan.parallel_plan import (
    ParallelPlan,
    ParallelSetup,
    build_parallel_plan,
)

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
    found = []
    for tp in SIZES:
        for sp in SIZES:
            for ep in _expert_sizes(s, world):
                if (not layout_problems("train", world, tp, sp, ep)
                        and shape_allows(s, tp, sp, ep)):  # fmt: skip
                    found.append((tp, sp, ep))
    return found


def rollout_layouts(s: PlanShape, world: int) -> list[tuple[int, int]]:
    """(tp, ep) of the rollout that tile ``world`` and divide the model."""
    return [(tp, ep) for tp in SIZES for ep in _expert_sizes(s, world)
            if not layout_problems("rollout", world, tp, 1, ep)
            and shape_allows(s, tp, 1, ep)]  # fmt: skip


def fits(plan: ParallelPlan) -> bool:
    """Every phase within the usable memory (generation without its KV cache, as
    memory_plan.checked_peak), the KV cache holding one sequence, and one sequence's share
    within the micro-batch (Ulysses splits it over sp)."""
    o, usable = plan.setup, usable_bytes(plan.setup.gpu_bytes)
    gpus = (False,) if o.colocated else (False, True)
    # generation without its KV cache, which the engine sizes from the memory then free
    within = all(phase_without_cache(plan, p, g) <= usable for p in plan.phases for g in gpus)
    return within and plan.kv.sequences >= 1 and o.micro_batch_tokens * o.sp >= o.max_seq_len


def best_rollout(s: PlanShape, setup: ParallelSetup) -> ParallelPlan | None:
    """``setup`` with the rollout layout that fits and holds the most of a step's wave at the
    smallest tp; None when no rollout layout fits beside the training state."""
    plans = []
    for tp, ep in rollout_layouts(s, setup.rollout_world):
        plan = build_parallel_plan(s, dataclasses.replace(setup, rollout_tp=tp, rollout_ep=ep))
        if fits(plan):
            plans.append(plan)
    if not plans:
        return None

    def preference(p: ParallelPlan):
        whole_wave = p.kv.sequences >= min(p.kv.wave, p.setup.rollout_max_seqs)
        return (not whole_wave, p.setup.rollout_tp, -p.kv.sequences * p.setup.replicas)

    return min(plans, key=preference)


@dataclass
class Recommendation:
    plan: ParallelPlan | None
    """The recommended layout's plan; None when nothing fits."""
    changes: list[str]
    """The config keys that give it."""
    closest: ParallelPlan | None = None
    """When nothing fits: the candidate that misses by the least."""


def recommend(s: PlanShape, base: ParallelSetup, checkpointing: str = "auto",
              offload: bool = True) -> Recommendation:  # fmt: skip
    """The preferred layout that fits (module docstring), with the keys to set.
    ``checkpointing``: true | false | auto (auto: tried off, then on)."""
    choices = {"auto": (False, True), "true": (True,), "false": (False,)}[checkpointing]
    offloads = (base.param_offload, True) if offload and not base.param_offload else (base.param_offload,)  # fmt: skip
    closest, closest_over = None, None
    for param_offload in offloads:
        candidates = sorted(
            ((tp, sp, ep, ckpt) for tp, sp, ep in training_layouts(s, base.world) for ckpt in choices),
            key=lambda c: (c[0] * c[1], c[3], c[0], -c[2]),
        )  # fmt: skip
        for tp, sp, ep, ckpt in candidates:
            setup = dataclasses.replace(base, tp=tp, sp=sp, ep=ep, gradient_checkpointing=ckpt,
                                        param_offload=param_offload)  # fmt: skip
            plan = best_rollout(s, setup)
            if plan is not None:
                return Recommendation(plan, layout_changes(plan.setup, base))
            attempt = build_parallel_plan(s, setup)
            over = overflow(attempt)
            if closest_over is None or over < closest_over:
                closest, closest_over = attempt, over
    return Recommendation(None, [], closest)


def overflow(plan: ParallelPlan) -> int:
    """Bytes by which the fullest phase (without the KV cache) exceeds the usable memory."""
    usable = usable_bytes(plan.setup.gpu_bytes)
    worst = max(phase_without_cache(plan, p) for p in plan.phases)
    return worst - usable


def phase_without_cache(plan: ParallelPlan, phase: str, rollout_gpu: bool = False) -> int:
    total = plan.phase_bytes(phase, rollout_gpu)
    if phase == GENERATE:
        total -= sum(i.gpu_bytes for i in plan.items if i.name.startswith("KV cache")
                     and i.rollout_gpu == rollout_gpu)  # fmt: skip
    return total


def layout_changes(o: ParallelSetup, base: ParallelSetup) -> list[str]:
    """The keys that turn ``base`` into ``o``."""
    keys = [("actor.tensor_parallel_size", o.tp, base.tp),
            ("actor.sequence_parallel_size", o.sp, base.sp),
            ("actor.expert_parallel_size", o.ep, base.ep),
            ("rollout.tensor_parallel_size", o.rollout_tp, base.rollout_tp),
            ("rollout.expert_parallel_size", o.rollout_ep, base.rollout_ep),
            ("model.gradient_checkpointing", o.gradient_checkpointing, base.gradient_checkpointing),
            ("actor.param_offload", o.param_offload, base.param_offload)]  # fmt: skip
    return [f"{key}={str(new).lower()}" for key, new, old in keys if new != old]


def why_nothing_fits(plan: ParallelPlan) -> str:
    """One paragraph: the closest layout, its fullest phase and what fills it."""
    o = plan.setup
    usable = usable_bytes(o.gpu_bytes)
    phase = max(plan.phases, key=lambda p: phase_without_cache(plan, p))
    items = ", ".join(f"{i.name} {gib(i.gpu_bytes)}" for i in plan.largest(phase))
    sequence = ""
    if o.micro_batch_tokens * o.sp < o.max_seq_len:
        sequence = (f"; one {o.max_seq_len:,}-token sequence needs micro-batches of "
                    f"{-(-o.max_seq_len // o.sp):,} tokens a GPU at sp {o.sp}")  # fmt: skip
    return (f"nothing fits on {o.world} GPUs of {gib(o.gpu_bytes)}: the closest layout (tp "
            f"{o.tp}, sp {o.sp}, ep {o.ep}{', offloaded' if o.param_offload else ''}) needs "
            f"{gib(phase_without_cache(plan, phase))} in the {phase} phase against "
            f"{gib(usable)} usable ({items}){sequence}: more GPUs, larger GPUs, or a shorter "
            f"actor.max_tokens_per_gpu")  # fmt: skip
