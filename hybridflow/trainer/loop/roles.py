"""Placement: which worker groups run the roles, on which devices (DESIGN.md §1, §3).

- ``colocate`` (hybrid engine): one group on every device holds actor + rollout (+ ref,
  + critic); the rollout reads the actor's weights in place on one device, or gathers them
  after each update when the actor is sharded.
- ``split``: the rollout gets ``trainer.rollout_gpus`` devices of its own; the actor (+ ref,
  + critic) the rest. After each update the actor's full weights go to the rollout group.

The reward model (reward.model.path) joins the training group, or, with
``reward.model.n_gpus_per_node`` > 0, gets a group on devices of its own after the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridflow.config import Config, Derived
from hybridflow.trainer.loop.device import resolve_device
from hybridflow.trainer.loop.role_handles import (
    ActorHandle,
    CriticHandle,
    GroupHandle,
    RefHandle,
    RewardModelHandle,
    RolloutHandle,
)

if TYPE_CHECKING:
    from hybridflow.trainer.observe.profiling import ProfilerHandle


@dataclass
class Roles:
    """The controller's handles: ``roles.actor.update(batch)``, ``roles.rollout.generate(…)``;
    each field's Protocol (trainer/loop/role_handles.py) names the worker code a call runs."""

    actor: ActorHandle
    rollout: RolloutHandle
    ref: RefHandle | None
    critic: CriticHandle | None
    split: bool
    """Rollout on devices of its own: weights travel through the controller."""
    rollout_dp: int
    """Ranks of the rollout group (a generate batch is split over them)."""
    groups: list[GroupHandle] = field(default_factory=list)
    reward_model: RewardModelHandle | None = None
    """The reward model (reward.model.path): on the training devices, or a group of its own."""
    reward_model_apart: bool = False
    """The reward model is on devices of its own: scoring may run beside training passes."""
    profilers: list[ProfilerHandle] = field(default_factory=list)
    """Each group's ``profiler`` role, when the run profiles steps (trainer/observe/profiling.py)."""

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()


def _pool(device: str, per_node: list[int], first_device: int = 0):
    from hybridflow.controller import ResourcePool

    if device == "cuda":
        return ResourcePool(gpus=per_node, first_device=first_device)
    return ResourcePool(cpus=per_node, first_device=first_device)


def build_roles(cfg: Config, derived: Derived) -> Roles:
    """Start the worker groups of this run (models are loaded inside the workers)."""
    roles = _training_roles(cfg, derived)
    if cfg.reward.model.path is None or cfg.reward.model.n_gpus_per_node == 0:
        return roles
    try:
        group = _reward_model_group(cfg)
    except BaseException:
        roles.shutdown()
        raise
    roles.groups.append(group)
    roles.reward_model, roles.reward_model_apart = group.reward_model, True
    if cfg.trainer.profile.steps:
        roles.profilers.append(group.profiler)
    return roles


def _group_options(cfg: Config) -> dict:
    t = cfg.trainer
    return dict(backend=t.backend, call_timeout_s=t.call_timeout_s,
                rendezvous_host=t.rendezvous_host, config=cfg)  # fmt: skip


def _reward_model_group(cfg: Config):
    """The reward model alone on reward.model.n_gpus_per_node devices after the trainer's
    (validate() checked the backend and the device count)."""
    from hybridflow.controller import WorkerGroup
    from hybridflow.workers import fused_worker

    t = cfg.trainer
    cls = fused_worker(actor=False, rollout=False, reward_model=True,
                       profiler=bool(t.profile.steps))  # fmt: skip
    pool = _pool(resolve_device(t.device), [cfg.reward.model.n_gpus_per_node],
                 first_device=t.n_gpus_per_node)  # fmt: skip
    return WorkerGroup(cls, pool, name="reward_model", **_group_options(cfg))


def _training_roles(cfg: Config, derived: Derived) -> Roles:
    """The actor, rollout, ref and critic groups (and the reward model when it shares the
    training devices)."""
    from hybridflow.controller import WorkerGroup
    from hybridflow.workers import fused_worker

    t = cfg.trainer
    device = resolve_device(t.device)
    options = _group_options(cfg)
    with_ref, with_critic = derived.use_reference, derived.use_critic
    with_rm = cfg.reward.model.path is not None and cfg.reward.model.n_gpus_per_node == 0
    profiler = bool(t.profile.steps)
    if t.placement == "colocate":
        cls = fused_worker(actor=True, rollout=True, ref=with_ref, critic=with_critic,
                           reward_model=with_rm, profiler=profiler)  # fmt: skip
        group = WorkerGroup(cls, _pool(device, [t.n_gpus_per_node] * t.nnodes), **options)
        return Roles(
            actor=group.actor,
            rollout=group.rollout,
            ref=group.ref if with_ref else None,
            critic=group.critic if with_critic else None,
            split=False,
            rollout_dp=group.world_size,
            groups=[group],
            reward_model=group.reward_model if with_rm else None,
            profilers=[group.profiler] if profiler else [],
        )
    # split placement, one node (validate() checked 0 < rollout_gpus < world)
    train_devices = t.n_gpus_per_node - t.rollout_gpus
    cls = fused_worker(actor=True, rollout=False, ref=with_ref, critic=with_critic,
                       reward_model=with_rm, profiler=profiler)  # fmt: skip
    train = WorkerGroup(cls, _pool(device, [train_devices]), name="train", **options)
    try:
        rollout = WorkerGroup(
            fused_worker(actor=False, rollout=True, profiler=profiler),
            _pool(device, [t.rollout_gpus], first_device=train_devices),
            name="rollout",
            **options,
        )
    except BaseException:
        train.shutdown()
        raise
    return Roles(
        actor=train.actor,
        rollout=rollout.rollout,
        ref=train.ref if with_ref else None,
        critic=train.critic if with_critic else None,
        split=True,
        rollout_dp=rollout.world_size,
        groups=[train, rollout],
        reward_model=train.reward_model if with_rm else None,
        profilers=[train.profiler, rollout.profiler] if profiler else [],
    )


def sync_weights(roles: Roles, version: int | None = None) -> None:
    """Make the rollout engine sample with the actor's current weights. version: the policy
    version its tokens record from now on (the step that made the weights; default: the
    engine's last + 1)."""
    if roles.split:
        roles.rollout.load_weights(roles.actor.full_weights(), version)
    else:
        roles.rollout.sync_from_actor(version)
