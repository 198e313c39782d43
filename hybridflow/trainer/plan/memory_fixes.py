"""A memory plan that does not fit: what overflows, and the changes that would make it fit,
each planned again with the change applied (alone, then together, then on more GPUs)."""

from __future__ import annotations

from hybridflow.config import Config, ConfigError, validate
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_from_config import plan_for_config, with_changes
from hybridflow.trainer.plan.memory_plan import MemoryPlan
from hybridflow.trainer.plan.memory_render import gib, usable_bytes

LORA_RANK_FIX = 64
"""model.lora_rank suggested for a full fine-tune that does not fit."""


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
    fewer blocks than one sequence of max_seq_len needs (paged: sizing.plan_blocks)."""
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
