"""The layout lines of ``hybridflow config plan`` under the memory table: the layout the run
uses, what a weight sync moves, and the layout the plan recommends (parallel_choice.py) with
its peak, or why nothing fits. The memory itself is the one plan's (memory_check.py)."""

from __future__ import annotations

from contextlib import nullcontext

from hybridflow.config import Config, Derived
from hybridflow.models.plan_shapes import shape_of
from hybridflow.parallel.roles import sizes_of
from hybridflow.trainer.plan.memory_plan import MemoryPlan
from hybridflow.trainer.plan.memory_render import gib, usable_bytes
from hybridflow.trainer.plan.parallel_choice import Recommendation, recommend
from hybridflow.trainer.plan.parallel_plan import reshard


def layout_line(cfg: Config, plan: MemoryPlan) -> str:
    """What the run trains and generates in: the actor's tp, sp and ep, its data-parallel
    ranks, the rollout's tp and replicas."""
    o = plan.options
    actor = sizes_of(cfg, "actor")
    dp = o.train_gpus // (actor["tp"] * actor["sp"])
    rollout_world = o.train_gpus if not o.split else cfg.trainer.rollout_gpus
    replicas = max(rollout_world // o.rollout_tp, 1)
    text = (f"layout: actor tp {actor['tp']} · sp {actor['sp']} · ep {actor['ep']} (data "
            f"parallel {dp}) on {o.train_gpus} GPU(s), rollout tp {o.rollout_tp} ({replicas} "
            f"replica{'s' if replicas > 1 else ''})")  # fmt: skip
    spread = f"rollout experts over {o.rollout_ep // o.rollout_tp} replicas (ep {o.rollout_ep})"
    extras = [w for w, on in (("experts whole on every rollout rank", o.rollout_experts_whole),
                              (spread, o.rollout_ep > 1),
                              ("gradient checkpointing", o.gradient_checkpointing),
                              ("training state on the host", o.param_offload and o.sharded))
              if on]  # fmt: skip
    return text + "".join(f", {e}" for e in extras)


def reshard_line(cfg: Config, plan: MemoryPlan) -> str:
    """What one weight sync moves into a rollout GPU, and about how long it takes."""
    o = plan.options
    rollout_gpus = cfg.trainer.rollout_gpus if o.split else 0
    r = reshard(shape_of(plan.architecture), o.train_gpus, o.rollout_tp,
                o.rollout_experts_whole, o.rollout_bytes, rollout_gpus,
                sync_bytes(cfg, plan), o.rollout_ep)  # fmt: skip
    return (f"reshard: {gib(r.bytes_in)} into each rollout GPU a sync, about {r.seconds:.2f} s "
            f"({r.link})")  # fmt: skip


def sync_bytes(cfg: Config, plan: MemoryPlan) -> int | None:
    """The most one GPU receives in a sync, block by block as engine/reshard.py moves them
    (parallel/reshard_plan.py), for a model colocated with the actor whose layouts the
    reshard runs (no expert-parallel actor); None otherwise (the plan's estimate stands)."""
    o = plan.options
    if o.split or o.ep > 1:
        return None
    from hybridflow.parallel.layout import rollout_layout, train_layout
    from hybridflow.parallel.reshard_plan import reshard_traffic

    train = train_layout(o.train_gpus, tp=o.tp, sp=o.sp)
    rollout = rollout_layout(o.train_gpus, tp=o.rollout_tp, ep=o.rollout_ep)
    split = cfg.rollout.expert_parallel_size != 1
    return reshard_traffic(plan.architecture, train, rollout, o.rollout_bytes, split).received


def parallel_lines(cfg: Config, derived: Derived, plan: MemoryPlan, fits: bool,
                   progress=None) -> list[str]:  # fmt: skip
    """The layout, the reshard (several GPUs) and the recommended layout when it differs from
    the configured one (or why nothing fits); ``progress`` (a ProgressReporter) is told of
    the reshard's planning and of the search for the layout."""
    lines = [layout_line(cfg, plan)]
    if derived.world_size > 1:  # block by block: a second or so for DeepSeek-V3 on 96 GPUs
        with progress.task("config plan: what a weight sync moves") if progress else nullcontext():
            lines.append(reshard_line(cfg, plan))
    if plan.options.gpu_bytes is None:
        return lines
    advice = recommend(cfg, plan.options.gpu_bytes, progress)
    if advice is not None and (advice.changes or not fits):
        lines.append(recommendation_text(advice, plan.options.gpu_bytes))
    return lines


def recommendation_text(advice: Recommendation, gpu_bytes: int) -> str:
    from hybridflow.trainer.plan.memory_fixes import overrides_text, peak_text

    if advice.plan is not None:
        keys = overrides_text(advice.changes) or "the configured layout"
        host = advice.plan.host_bytes()  # one node's share of what it offloads
        offloaded = f"; {gib(host)} of host memory a node for what it offloads" if host else ""
        return f"recommended layout: {keys} ({peak_text(advice.plan)}{offloaded})"
    if advice.closest is None:
        return "no layout fits, and none is valid for this config"
    phase, peak = advice.closest.checked_peak()
    largest = ", ".join(f"{i.name} {gib(i.gpu_bytes)}" for i in advice.closest.largest(phase))
    return (f"no layout fits on GPUs of {gib(gpu_bytes)}: the closest "
            f"({overrides_text(advice.closest_changes or {}) or 'the configured one'}) needs "
            f"{gib(peak)} in the {phase} against {gib(usable_bytes(gpu_bytes))} usable "
            f"({largest}): more GPUs, larger GPUs, or a shorter actor.max_tokens_per_gpu")  # fmt: skip
