"""``hybridflow config plan`` on several GPUs: the configured layout's memory per GPU, role by
role and phase by phase, the layout the plan recommends, and why nothing fits when nothing
does (the arithmetic: parallel_plan.py; the choice: parallel_choice.py)."""

from __future__ import annotations

from hybridflow.config import Config, Derived
from hybridflow.config.rollout_section import kv_memory_share
from hybridflow.config.sections import UNPLANNED_UPDATE_BUDGET
from hybridflow.models.plan_shapes import PLAN_ONLY_SHAPES, PlanShape, shape_of
from hybridflow.parallel.roles import sizes_of
from hybridflow.trainer.plan.memory_render import count, gib, usable_bytes
from hybridflow.trainer.plan.parallel_choice import (
    Recommendation,
    fits,
    phase_without_cache,
    recommend,
    why_nothing_fits,
)
from hybridflow.trainer.plan.parallel_plan import (
    ParallelPlan,
    ParallelSetup,
    build_parallel_plan,
)

MASTER_BYTES = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}
"""model.dtype -> bytes of the trained weights on a GPU (fp32 masters for auto)."""


def plan_shape_for(cfg: Config) -> tuple[str, PlanShape] | None:
    """(name, shape) of the policy: a plan-only shape, a preset or a config.json; None when
    unknown."""
    if cfg.model.path in PLAN_ONLY_SHAPES:
        return cfg.model.path, PLAN_ONLY_SHAPES[cfg.model.path]
    from hybridflow.trainer.plan.memory_check import model_architecture_for

    found = model_architecture_for(cfg)
    return None if found is None else (found[0], shape_of(found[1]))


def uses_parallel_layouts(cfg: Config) -> bool:
    """A layout beyond data parallelism, or a shape only this plan prices."""
    sizes = [*sizes_of(cfg, "actor").values(), *sizes_of(cfg, "rollout").values()]
    return max(sizes) > 1 or cfg.model.path in PLAN_ONLY_SHAPES


def setup_from_config(cfg: Config, derived: Derived, gpu_bytes: int) -> ParallelSetup:
    """What the parallel plan needs, read off a validated config."""
    a, r, t = cfg.actor, cfg.rollout, cfg.trainer
    actor, rollout = sizes_of(cfg, "actor"), sizes_of(cfg, "rollout")
    max_len = derived.max_sequence_length
    if isinstance(a.max_tokens_per_gpu, int):
        tokens = a.max_tokens_per_gpu
    elif a.max_tokens_per_gpu == "auto":  # one sequence's share at least
        tokens = max(UNPLANNED_UPDATE_BUDGET, -(-max_len // actor["sp"]))
    else:
        tokens = a.micro_batch_size_per_gpu * max_len
    split = t.placement == "split"
    return ParallelSetup(
        gpu_bytes=gpu_bytes,
        world=derived.world_size - (t.rollout_gpus if split else 0),
        tp=actor["tp"], sp=actor["sp"], ep=actor["ep"],
        rollout_tp=rollout["tp"], rollout_ep=rollout["ep"],
        rollout_experts_whole=r.expert_parallel_size == 1 and rollout["tp"] > 1,
        rollout_gpus=t.rollout_gpus if split else 0,
        master_bytes=MASTER_BYTES.get(cfg.model.dtype, 4),
        param_offload=a.param_offload,
        gradient_checkpointing=cfg.model.gradient_checkpointing is True,
        micro_batch_tokens=tokens,
        max_seq_len=max_len,
        samples_per_step=derived.samples_per_step,
        rollout_max_seqs=r.max_num_seqs,
        gpu_memory_utilization=kv_memory_share(r, t),
        max_prefill_tokens=r.engine.max_prefill_tokens,
        reference=derived.use_reference,
        critic=derived.use_critic,
    )  # fmt: skip


def layout_line(o: ParallelSetup) -> str:
    dp = o.world // (o.tp * o.sp)
    actor = f"actor tp {o.tp} · sp {o.sp} · ep {o.ep} (data parallel {dp})"
    rollout = f"rollout tp {o.rollout_tp}" + (f" · ep {o.rollout_ep}" if o.rollout_ep > 1 else "")
    extras = [w for w, on in (("gradient checkpointing", o.gradient_checkpointing),
                              ("training state on the host", o.param_offload)) if on]  # fmt: skip
    replicas = f"{o.replicas} replica" + ("s" if o.replicas > 1 else "")
    return f"{actor}, {rollout} ({replicas})" + "".join(f", {e}" for e in extras)


def render_plan(plan: ParallelPlan) -> list[str]:
    """Item rows (per GPU, the phases holding each), the phase totals, the KV cache, the
    reshard and the host memory."""
    o, short = plan.setup, {"weight sync": "sync", "generation": "gen", "actor update": "update",
                            "optimizer step": "step", "critic update": "critic"}  # fmt: skip
    lines = [f"    {'item':<58} {'per GPU':>10}  held in"]
    for item in plan.items:
        where = "rollout GPU" if item.rollout_gpu else " ".join(short[p] for p in item.phases)
        note = f"  ({item.note})" if item.note else ""
        lines.append(f"    {item.name:<58} {gib(item.gpu_bytes):>10}  {where}{note}")
    gpus = (False,) if o.colocated else (False, True)
    for rollout_gpu in gpus:
        totals = " · ".join(f"{p} {gib(phase_without_cache(plan, p, rollout_gpu) if p != 'generation' else plan.phase_bytes(p, rollout_gpu))}"
                            for p in plan.phases if plan.phase_bytes(p, rollout_gpu))  # fmt: skip
        lines.append(f"    per {'rollout' if rollout_gpu else 'training'} GPU: {totals}")
    kv = plan.kv
    lines.append(f"    KV cache: {kv.sequences:,} sequences of {o.max_seq_len:,} tokens at once a "
                 f"replica (a step asks {kv.wave:,} of each of the {o.replicas} replicas)")  # fmt: skip
    r = plan.reshard
    lines.append(f"    reshard: {gib(r.bytes_in)} into each rollout GPU a sync, about "
                 f"{r.seconds:.2f} s ({r.link}); transient: one bucket")  # fmt: skip
    host = sum(i.host_bytes for i in plan.items)
    if host:
        nodes = max(1, -(-o.world // 8))
        lines.append(f"    host: {gib(host // nodes)} a node of 8 GPUs (training state offloaded)")
    return lines


def parallel_section(cfg: Config, derived: Derived, gpu_bytes: int) -> tuple[list[str], list[str]]:
    """(lines to print, problems) of the configured layout and the recommended one; the
    problems are for a configured layout that does not fit."""
    found = plan_shape_for(cfg)
    if found is None:
        return [], []
    name, shape = found
    setup = setup_from_config(cfg, derived, gpu_bytes)
    plan = build_parallel_plan(shape, setup, sync_bytes(cfg, setup))
    moe = f", {shape.experts} experts ({shape.experts_per_token} a token)" if shape.is_moe else ""
    lines = [f"Parallel layout plan: {name} ({count(shape.total_params)} parameters{moe}) on "
             f"{setup.world} GPUs of {gib(gpu_bytes)} ({gib(usable_bytes(gpu_bytes))} usable)"
             + ("" if setup.colocated else f", rollout on {setup.rollout_gpus} GPUs of its own")]  # fmt: skip
    if shape.plan_only:
        lines.append(f"  {name}: {shape.plan_only}")
    if cfg.model.lora_rank > 0:
        lines.append("  (planned as a full fine-tune: LoRA is not in the parallel plan)")
    checkpointing = str(cfg.model.gradient_checkpointing).lower()
    advice = recommend(shape, setup, checkpointing)
    verdict = "fits" if fits(plan) else "does not fit"
    lines.append(f"  configured: {layout_line(setup)}: {verdict}")
    lines += render_plan(plan)
    problems = [] if fits(plan) else [_problem(setup, advice)]
    if advice.plan is not None and advice.changes and not fits(plan):
        lines.append(f"  recommended: {layout_line(advice.plan.setup)}")
        lines.append(f"    set: {' '.join(advice.changes)}")
        recommended = advice.plan.setup
        lines += render_plan(build_parallel_plan(shape, recommended,
                                                 sync_bytes(cfg, recommended)))  # fmt: skip
    elif advice.plan is None and advice.closest is not None:
        lines.append(f"  {why_nothing_fits(advice.closest)}")
    return lines, problems


def sync_bytes(cfg: Config, setup: ParallelSetup) -> int | None:
    """The most one GPU receives in a sync, block by block as engine/reshard.py moves them
    (parallel/reshard_plan.py), for a model colocated with the actor whose layouts the
    reshard runs (no expert-parallel actor; a mixture of experts' rollout experts split
    over its tp ranks, or held whole with rollout.expert_parallel_size=1); None otherwise
    (the plan's estimate stands)."""
    if not setup.colocated or setup.ep > 1 or setup.rollout_ep not in (1, setup.rollout_tp):
        return None
    from hybridflow.parallel.layout import rollout_layout, train_layout
    from hybridflow.parallel.reshard_plan import reshard_traffic
    from hybridflow.trainer.plan.memory_check import model_architecture_for

    found = model_architecture_for(cfg)
    if found is None:
        return None
    train = train_layout(setup.world, tp=setup.tp, sp=setup.sp)
    rollout = rollout_layout(setup.world, tp=setup.rollout_tp)
    split = setup.rollout_ep > 1 or cfg.rollout.expert_parallel_size != 1
    return reshard_traffic(found[1], train, rollout, setup.rollout_bytes, split).received


def _problem(setup: ParallelSetup, advice: Recommendation) -> str:
    if advice.plan is None:
        return why_nothing_fits(advice.closest) if advice.closest else "no layout fits"
    return (
        f"the configured layout ({layout_line(setup)}) does not fit the GPUs' memory; "
        f"the plan recommends: {' '.join(advice.changes)}"
    )
