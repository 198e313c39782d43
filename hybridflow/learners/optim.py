"""AdamW, learning-rate schedules, and gradient clipping that skips non-finite steps."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(
    step: int,
    *,
    schedule: str,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> float:
    """Factor applied to the peak learning rate at scheduler step ``step`` (0-based).

    Warm-up: linear from ``1/(warmup+1)`` at step 0 up to 1 at step ``warmup_steps`` (step 0
    does get a small non-zero LR: a step at LR 0 would be a wasted RL step). After it:
    ``constant`` stays at 1; ``linear`` decays linearly and ``cosine`` along a half cosine, both
    from 1 to ``min_lr_ratio`` at ``total_steps`` (and stay there after it).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_optimizer(
    params: Iterable[nn.Parameter],
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    device: torch.device | str = "cpu",
    per_tensor: bool = False,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; fused kernel on CUDA (one launch per step).
    per_tensor: one update per tensor (DTensors over different meshes, as expert parallelism
    has, cannot share a foreach or fused launch)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: is every weight frozen?")
    fused = torch.device(device).type == "cuda" and all(p.is_cuda for p in trainable)
    if per_tensor:
        return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay,
                                 betas=tuple(betas), foreach=False)  # fmt: skip
    return torch.optim.AdamW(
        trainable, lr=lr, weight_decay=weight_decay, betas=tuple(betas), fused=fused or None
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    schedule: str,
    warmup_steps: int,
    total_steps: int | Callable[[], int],
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR driven by :func:`lr_multiplier` (state_dict holds only the step count).

    ``total_steps`` may be a callable, read at every step, for a length known only later
    (the learners learn the optimizer steps per RL step from the first batch)."""
    lr_multiplier(0, schedule=schedule, warmup_steps=0, total_steps=1)  # validate the name now

    def factor(step: int) -> float:
        return lr_multiplier(
            step,
            schedule=schedule,
            warmup_steps=warmup_steps,
            total_steps=total_steps() if callable(total_steps) else total_steps,
            min_lr_ratio=min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def global_grad_norm(
    params: list[nn.Parameter],
    *,
    group: dist.ProcessGroup | None = None,
    comm_device: torch.device | str | None = None,
) -> float:
    """Global L2 norm of the gradients (fp32 accumulation), possibly ``inf``/``nan``.

    Sharded gradients (FSDP2, tensor parallelism) are DTensors over ranks of ``group``: the
    squared norms of the local shards are summed and all-reduced on ``comm_device``
    (explicitly, so that CPU-offloaded shards work with NCCL, where DTensor's own reduction
    would not). A tensor held whole or split over fewer ranks than the group has (a norm
    weight beside tensor-parallel layers) is counted once: each rank's part is weighted by
    its distinct shards / the group's ranks.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    sharded = any(hasattr(g, "to_local") for g in grads)
    world = dist.get_world_size(group) if sharded and dist.is_initialized() else 1
    device = torch.device(comm_device) if comm_device is not None else grads[0].device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.numel():
            square = torch.linalg.vector_norm(local, dtype=torch.float32).square().to(device)
            copies = world // distinct_shards(grad)
            squares += square / copies if copies > 1 else square
    if world > 1:
        dist.all_reduce(squares, group=group)
    return float(squares.sqrt())


def distinct_shards(tensor: torch.Tensor) -> int:
    """Into how many different pieces a (D)Tensor is split over its mesh (1: whole)."""
    placements = getattr(tensor, "placements", ())
    mesh = getattr(tensor, "device_mesh", None)
    # not is_shard(): FSDP2 over tensor-parallel weights places a _StridedShard, no Shard
    return math.prod(mesh.size(i) for i, p in enumerate(placements) if not p.is_replicate())


def clip_factor(norm: float, max_norm: float) -> float | None:
    """What the gradients are multiplied by to clip a norm of ``norm`` to ``max_norm``;
    None when no clipping applies (``max_norm <= 0``, norm below it, or not finite)."""
    if math.isfinite(norm) and max_norm > 0 and norm > max_norm:
        return max_norm / (norm + 1e-6)
    return None


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    *,
    group: dist.ProcessGroup | None = None,
    comm_device: torch.device | str | None = None,
) -> float:
    """Global L2 norm of the gradients (:func:`global_grad_norm`), clipped in place to
    ``max_norm`` when it is finite and ``max_norm > 0``. Returns the norm before clipping,
    possibly ``inf``/``nan``: the caller then skips the optimizer step."""
    norm = global_grad_norm(params, group=group, comm_device=comm_device)
    factor = clip_factor(norm, max_norm)
    if factor is not None:
        # A Python scalar multiplies plain tensors and FSDP DTensor shards alike.
        for param in params:
            if param.grad is not None:
                param.grad.mul_(factor)
    return norm


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            # AdamW's "step" counter stays where it is (CPU scalar unless fused/capturable).
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


HYPERPARAMETERS = ("initial_lr", "weight_decay", "betas", "eps")
"""Optimizer settings the run's config decides; a resumed run applies its own values."""


def hyperparameters(optimizer) -> list[dict]:
    if optimizer is None:
        return []
    return [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in optimizer.param_groups]


def apply_hyperparameters(optimizer, scheduler, configured: list[dict]) -> None:
    """After loading a checkpoint: keep its moments and schedule position, but this run's
    peak LR, weight decay, betas and eps (a changed ``actor.lr`` takes effect on resume).
    The current LR is rescaled by new peak / saved peak, which is exactly 1.0 when the LR
    did not change, so an unchanged resume stays bit-exact."""
    for group, config in zip(optimizer.param_groups, configured):
        saved_peak = group.get("initial_lr", config.get("initial_lr"))
        group.update(config)
        if saved_peak and "initial_lr" in config:
            group["lr"] = group["lr"] * (config["initial_lr"] / saved_peak)
    if scheduler is not None and configured and "initial_lr" in configured[0]:
        scheduler.base_lrs = [config["initial_lr"] for config in configured]
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
