"""Loading the models a role needs, on the device of its worker."""

from __future__ import annotations

import os

import torch
from torch import nn

from hybridflow.config import ModelConfig

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(model_cfg: ModelConfig, device: str) -> torch.dtype:
    """``model.dtype``: auto is bf16 on a GPU (the rollout engine reads these weights in
    place, so they are what it samples with) and fp32 on the CPU."""
    if model_cfg.dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return DTYPES[model_cfg.dtype]


def training_dtype(model_cfg: ModelConfig) -> torch.dtype:
    """Parameter dtype of the models being trained (actor, critic). ``auto`` keeps fp32 master
    weights and computes in bf16 on a GPU (autocast, or FSDP2's mixed-precision policy):
    with bf16 parameters an AdamW step of lr 1e-6 is below bf16's resolution (~4e-3 relative)
    and most updates would be rounded away. The rollout engine then samples with a bf16 copy
    refreshed at each weight sync."""
    if model_cfg.dtype == "auto":
        return torch.float32
    return DTYPES[model_cfg.dtype]


def load_causal_lm(path: str, dtype: torch.dtype, device: str) -> nn.Module:
    """A CausalLM from a local HF directory or a shape preset (random weights, fixed seed).

    ``sft:<task>`` paths are resolved to a directory by the trainer before workers start."""
    if path.startswith("sft:"):
        raise ValueError(
            f"model path {path!r} must be resolved to the cached SFT model directory first "
            "(hybridflow.trainer.loop.warm_start.resolve_model_path)"
        )
    from hybridflow.models import load_model

    return load_model(path, dtype=dtype, device=device)


def set_cpu_threads(config, device: str) -> None:
    """Apply ``trainer.cpu_threads`` in this process when it computes on the CPU."""
    threads = config.trainer.cpu_threads
    if threads is not None and not str(device).startswith("cuda"):
        torch.set_num_threads(threads)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's share)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_threads_note(threads: int | None, processes: int, cores: int) -> str | None:
    """The line a CPU run prints once when ``trainer.cpu_threads`` leaves cores idle:
    ``processes`` processes of ``threads`` threads each on a host of ``cores`` cores. None
    when every core is used (or torch picks: ``threads`` None)."""
    if threads is None or threads * processes >= cores:
        return None
    used = threads * processes
    return (
        f"trainer.cpu_threads = {threads}: {processes} process{'es' * (processes != 1)} × "
        f"{threads} thread{'s' * (threads != 1)} use {used} of this host's {cores} cores (one "
        f"thread is fastest for the tiny presets); for a larger model set "
        f"trainer.cpu_threads={max(cores // processes, 1)}, or null for torch's default"
    )


def idle_cores_line(config, device: str) -> str | None:
    """:func:`cpu_threads_note` for a run on ``device``: its CPU processes are the
    controller (``inprocess``) or one per device of this node (``local``, ``ray``)."""
    if str(device).startswith("cuda"):
        return None
    t = config.trainer
    processes = 1 if t.backend == "inprocess" else t.n_gpus_per_node
    return cpu_threads_note(t.cpu_threads, processes, available_cores())


def default_tokenizer_path(model: ModelConfig) -> str:
    """``model.tokenizer_path``, else the char tokenizer for ``sft:`` and presets (with the
    vision tokens for a vision-language preset or an image task's warm start), else the model
    directory's own."""
    from hybridflow.data.builtin import IMAGE_TASKS
    from hybridflow.models import PRESETS

    if model.tokenizer_path:
        return model.tokenizer_path
    if model.path.startswith("sft:") or model.path in PRESETS:
        vision = model.path.removeprefix("sft:") in IMAGE_TASKS or (
            model.path in PRESETS and PRESETS[model.path].vision is not None)  # fmt: skip
        return "char-vl" if vision else "char"
    return model.path


def training_mesh(config, role: str, world_size: int, device: str, reuse=None):
    """The ``role``'s parallel layout (actor, ref, critic) over this worker group's ranks as a
    RoleMesh, or None when every size is 1 (data parallelism over the default group, the
    learners' path without a mesh). ``reuse``: a colocated role's mesh, taken when the layout
    is the same (one set of process groups per layout)."""
    from hybridflow.parallel import build_mesh, train_layout
    from hybridflow.parallel.roles import sizes_of

    sizes = sizes_of(config, role)
    if all(size == 1 for size in sizes.values()):
        return None
    layout = train_layout(world_size, **sizes)
    if reuse is not None and reuse.layout == layout:
        return reuse
    return build_mesh(layout, torch.device(device).type)
