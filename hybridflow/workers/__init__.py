"""Roles as worker classes whose methods the controller calls (DESIGN.md §2, Controller).

    group = WorkerGroup(ActorRolloutRef, pool, backend="local", config=cfg)
    gen = group.rollout.generate(prompts)        # hybrid engine: same weights as group.actor
    group.actor.update(batch)

Roles are composed, never subclassed: ``fuse`` puts several in one process per device (the
hybrid engine), and a role built after ``actor`` finds it in ``context.colocated``.
"""

from __future__ import annotations

from hybridflow.controller import fuse
from hybridflow.workers.actor import ActorWorker, RefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.profiler import ProfilerWorker
from hybridflow.workers.reward_model import RewardModelWorker
from hybridflow.workers.rollout import RolloutWorker

__all__ = [
    "ActorRolloutRef",
    "ActorWorker",
    "CriticWorker",
    "ProfilerWorker",
    "RefWorker",
    "RewardModelWorker",
    "RolloutWorker",
    "fused_worker",
]


def fused_worker(
    *,
    actor: bool = True,
    rollout: bool = True,
    ref: bool = False,
    critic: bool = False,
    reward_model: bool = False,
    profiler: bool = False,
) -> type:
    """One worker class holding the chosen roles (actor first: the others read its weights;
    the profiler last: it names its traces by the roles before it)."""
    chosen = {
        "actor": ActorWorker if actor else None,
        "rollout": RolloutWorker if rollout else None,
        "ref": RefWorker if ref else None,
        "critic": CriticWorker if critic else None,
        "reward_model": RewardModelWorker if reward_model else None,
        "profiler": ProfilerWorker if profiler else None,
    }
    return fuse(**{name: cls for name, cls in chosen.items() if cls is not None})


ActorRolloutRef = fused_worker(actor=True, rollout=True, ref=True)
"""The hybrid engine: actor training, rollout on the same parameters, and the reference."""
