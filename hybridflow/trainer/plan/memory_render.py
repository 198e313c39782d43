"""The memory plan as a table, and whether it fits a GPU (the arithmetic: memory_plan.py)."""

from __future__ import annotations

from hybridflow.trainer.plan.memory_plan import (
    ALWAYS,
    CRITIC,
    GENERATE,
    GIB,
    HEADROOM_BYTES,
    HEADROOM_FRACTION,
    PHASES,
    MemoryPlan,
    trainable_parameters,
)


def count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n else "-"


def usable_bytes(gpu_bytes: int) -> int:
    """What the plan may fill: the GPU less the headroom for what it does not count."""
    return int(gpu_bytes * (1 - HEADROOM_FRACTION)) - HEADROOM_BYTES


def render(plan: MemoryPlan, gpu_source: str = "", on_cpu: bool = False) -> str:
    """The plan as a table: one row per item, then the peak of each phase and the verdict.
    ``on_cpu``: the run trains in CPU processes, so the table is what each GPU would hold if
    it ran on GPUs, and the run's own memory is the host line (host_memory.py)."""
    a, o = plan.architecture, plan.options
    total, trained = a.num_parameters(), trainable_parameters(a, o)
    placement = "split, rollout on GPUs of its own" if o.split else "colocated"
    active = (  # a mixture of experts: what one token runs through
        f", {count(a.num_parameters(active=True))} active ({a.num_experts_per_tok} of "
        f"{a.num_experts} experts)"
        if a.is_moe
        else ""
    )
    devices = "CPU process(es)" if on_cpu else "GPU(s)"
    lines = [
        f"memory plan: {plan.model} ({count(total)} parameters{active}, {count(trained)} "
        f"trained), {o.train_gpus} training {devices}, {placement}",
    ]
    if on_cpu:
        lines.append("  trainer.device=cpu: the 'per GPU' column is what each GPU would hold "
                     "with trainer.device=cuda; this run's memory is the host line below")  # fmt: skip
    lines.append(f"  {'item':<52} {'per GPU':>10} {'host':>10}  held during")
    for item in plan.items:
        when = "always" if item.phases == ALWAYS else ", ".join(item.phases) or "-"
        if item.rollout_gpu:
            when = f"rollout GPU: {when}"
        note = f" ({item.note})" if item.note else ""
        lines.append(f"  {item.name:<52} {gib(item.gpu_bytes):>10} {gib(item.host_bytes):>10}"
                     f"  {when}{note}")  # fmt: skip
    phases = [p for p in PHASES if p != CRITIC or o.critic]
    peaks = " | ".join(f"{p} {gib(plan.phase_bytes(p))}" for p in phases)
    per = "per GPU, were it trained on GPUs" if on_cpu else "per training GPU"
    host = f"host {gib(plan.host_bytes())}"
    if o.gpus_per_host < o.train_gpus:  # several nodes: the host column is one node's
        host += f" a node (the shares of its {o.gpus_per_host} GPUs)"
    lines.append(f"  {per}: {peaks}; {host}")
    if o.split:
        lines.append(f"  per rollout GPU: {gib(plan.phase_bytes(GENERATE, rollout_gpu=True))}")
    lines.append("  " + verdict(plan, gpu_source))
    return "\n".join(lines)


def verdict(plan: MemoryPlan, gpu_source: str = "") -> str:
    o = plan.options
    phase, peak = plan.peak()
    if o.gpu_bytes is None:
        return (f"peak {gib(peak)} ({phase}); GPU memory unknown, fit not checked "
                "(give --gpu-memory or trainer.gpu_memory_gib)")  # fmt: skip
    usable = usable_bytes(o.gpu_bytes)
    source = f" ({gpu_source})" if gpu_source else ""
    fits = plan.checked_peak()[1] <= usable and plan.kv_slots > 0
    if o.split:
        fits = fits and plan.checked_peak(rollout_gpu=True)[1] <= usable
    room = "no KV-cache slot" if o.kv_block_size is None else "no sequence's KV blocks"
    word = "fits" if fits else "does NOT fit" + ("" if plan.kv_slots else f", {room}")
    return (f"GPU {gib(o.gpu_bytes)}{source}, {gib(usable)} usable: {word}, peak {gib(peak)} "
            f"({phase})")  # fmt: skip
