"""A :class:`~hybridflow.learners.core.TrainCore`'s sharded checkpoint: model and optimizer
through torch.distributed.checkpoint, and per rank the scheduler, counters and RNG state
(``extra_rank{r}.pt``) that a bit-exact resume needs.

Plain functions over the core: it owns the module, the optimizer and the state writer;
this module only knows how they are written and read back. It names what it reads of the
core in :class:`CheckpointedCore`, so it needs no import of the core that calls it.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.learners.host_optimizer import offloaded_state_dicts, restore_loaded
from hybridflow.learners.optim import apply_hyperparameters, hyperparameters
from hybridflow.learners.sharding.train_groups import TrainGroups, distributed_on, distributed_world


class CheckpointedCore(Protocol):
    """What the save and the load read of a TrainCore (learners/core.py)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    host_optimizer: object | None  # learners/host_optimizer.py's HostAdamW
    scheduler: object | None
    groups: TrainGroups
    device: torch.device
    state_writer: object  # learners/state_writer.py

    def on_device(self) -> AbstractContextManager[None]: ...

    def save_finished(self) -> bool: ...


def save_checkpoint(
    core: CheckpointedCore,
    directory: str | os.PathLike,
    extra: dict,
    *,
    trainable_only: bool,
    background: bool = False,
) -> None:
    """Sharded model + optimizer via torch.distributed.checkpoint; scheduler, counters and
    this rank's RNG state in ``extra_rank{r}.pt`` (what a bit-exact resume needs).
    background: copy the state to host memory and write it on a thread
    (learners/state_writer.py); ``core.save_finished()`` says when it is on disk."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    extra = dict(extra)
    if core.scheduler is not None:
        extra["scheduler"] = core.scheduler.state_dict()
    extra["rng_cpu"] = torch.get_rng_state()
    if core.device.type == "cuda":
        extra["rng_cuda"] = torch.cuda.get_rng_state(core.device)
    host, optimizer = core.host_optimizer, core.optimizer
    with core.on_device():
        model_state, optim_state = get_state_dict(
            core.module, optimizer if optimizer is not None and host is None else [],
            options=options,
        )  # fmt: skip
        if host is not None:  # the masters and moments are the host optimizer's
            model_state, optim_state = offloaded_state_dicts(host, core.module, model_state)
        state = {"model": keep_trainable(core.module, model_state, trainable_only)}
        if optimizer is not None:
            state["optimizer"] = optim_state
        extra_path = directory / f"extra_rank{core.groups.role_rank}.pt"
        core.state_writer.write(state, directory, extra, extra_path, background=background)
    if not background:
        role_barrier(core.groups)


def load_checkpoint(
    core: CheckpointedCore, directory: str | os.PathLike, *, trainable_only: bool
) -> dict:
    """Inverse of :func:`save_checkpoint` (same world size); returns the ``extra`` dict."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    from hybridflow.dcp_reader import load_state
    from hybridflow.state_files import load_state_file

    core.state_writer.wait()  # a save still writing must not race the loaded state
    directory = Path(directory)
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    configured = hyperparameters(core.optimizer)  # this run's config, before loading
    host = core.host_optimizer
    with core.on_device():
        # A host optimizer's moments and masters are not the module's: load them in place.
        optimizers = [core.optimizer] if core.optimizer is not None and not host else []
        model_state, optim_state = get_state_dict(core.module, optimizers, options=options)
        if host is not None:
            model_state, optim_state = offloaded_state_dicts(host, core.module, model_state)
        state = {"model": keep_trainable(core.module, model_state, trainable_only)}
        if core.optimizer is not None:
            state["optimizer"] = optim_state
        # tensors and plain values only: DCP's own loader would unpickle what the files say
        load_state(state, directory, checkpoint_group(core.groups), distributed=distributed_on())
        set_state_dict(
            core.module,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optimizer", {}) if optimizers else {},
            options=StateDictOptions(ignore_frozen_params=trainable_only, strict=False),
        )
        if host is not None:
            restore_loaded(host, state["optimizer"])
    extra_path = directory / f"extra_rank{core.groups.role_rank}.pt"
    extra = load_state_file(extra_path)  # tensors and plain data only
    if core.scheduler is not None and "scheduler" in extra:
        core.scheduler.load_state_dict(extra["scheduler"])
    if core.optimizer is not None:
        apply_hyperparameters(core.optimizer, core.scheduler, configured)
    torch.set_rng_state(extra["rng_cpu"])
    if core.device.type == "cuda" and "rng_cuda" in extra:
        torch.cuda.set_rng_state(extra["rng_cuda"], core.device)
    return extra


def keep_trainable(module: nn.Module, model_state: dict, trainable_only: bool) -> dict:
    """Drop frozen tensors. ``ignore_frozen_params`` alone keeps a tied lm_head (a
    duplicate name of the frozen embedding), which would put the whole vocabulary matrix
    into a LoRA adapter checkpoint."""
    if not trainable_only:
        return model_state
    trainable = {
        name
        for name, param in module.named_parameters(remove_duplicate=False)
        if param.requires_grad
    }
    return {name: value for name, value in model_state.items() if name in trainable}


def checkpoint_group(groups: TrainGroups) -> dist.ProcessGroup | None:
    """The group a checkpoint is written and read over: the role's ranks (None: one process)."""
    return groups.role if distributed_on() else None


def role_barrier(groups: TrainGroups) -> None:
    """Wait for every rank of the role (no-op on one rank)."""
    if distributed_world(groups.role) > 1:
        dist.barrier(group=groups.role)
