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
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; fused kernel on CUDA (one launch per step)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: is every weight frozen?")
    fused = torch.device(device).type == "cuda" and all(p.is_cuda for p in trainable)
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


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    *,
    group: dist.ProcessGroup | None = None,
    comm_device: torch.device | str | None = None,
) -> float:
    """Global L2 norm of the gradients, clipped in place to ``max_norm`` when it is finite
    and ``max_norm > 0``. Returns the norm before clipping, possibly ``inf``/``nan``: the
    caller then skips the optimizer step.

    FSDP2 gradients are DTensors sharded over ``group``: the squared norms of the local
    shards are summed and all-reduced on ``comm_device`` (explicitly, so that CPU-offloaded
    shards work with NCCL, where DTensor's own reduction would not).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    sharded = any(hasattr(g, "to_local") for g in grads)
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    device = torch.device(comm_device) if comm_device is not None else local[0].device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for tensor in local:
        if tensor.numel():
            squares += torch.linalg.vector_norm(tensor, dtype=torch.float32).square().to(device)
    if sharded and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    norm = float(squares.sqrt())
    if math.isfinite(norm) and max_norm > 0 and norm > max_norm:
        # A Python scalar multiplies plain tensors and FSDP DTensor shards alike.
        scale = max_norm / (norm + 1e-6)
        for grad in grads:
            grad.mul_(scale)
    return norm
