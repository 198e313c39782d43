"""Each role's layout read off the config: which keys set it, and the Layout values.

The actor's sizes are ``actor.{tensor,sequence,expert}_parallel_size``; the reference and
the critic take the actor's unless their own keys are set; the rollout has
``rollout.tensor_parallel_size`` and ``rollout.expert_parallel_size``. A training role's
ranks are the training devices (all of them when colocated), the rollout's the rollout
devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridflow.parallel.layout import (
    ROLLOUT,
    TRAIN,
    Layout,
    RoleLayouts,
    rollout_layout,
    train_layout,
)

if TYPE_CHECKING:
    from hybridflow.config.sections import Config

DIM_KEYS = {
    "tp": "tensor_parallel_size",
    "sp": "sequence_parallel_size",
    "ep": "expert_parallel_size",
}
"""Layout dimension -> the config key that sets it, in every role's section."""

ROLE_DIMS = {"actor": ("tp", "sp", "ep"), "ref": ("tp", "sp", "ep"),
             "critic": ("tp", "sp", "ep"), "rollout": ("tp", "ep")}  # fmt: skip
"""The dimensions each role's section has."""


@dataclass(frozen=True)
class RoleSize:
    """One dimension of one role as the config sets it."""

    role: str
    dim: str
    """tp | sp | ep."""
    value: int
    key: str
    """The key that decides it: ``ref.tensor_parallel_size``, or ``actor.…`` when the
    reference's own key is unset and it follows the actor."""


def role_sizes(cfg: Config) -> list[RoleSize]:
    """Every role's tp/sp/ep as configured, with the key that set each one."""
    sizes = []
    for role, dims in ROLE_DIMS.items():
        section = getattr(cfg, role)
        for dim in dims:
            key = DIM_KEYS[dim]
            own = getattr(section, key)
            if own is None and role == "rollout":  # its experts split over the tp ranks:
                sizes.append(RoleSize(role, dim, 1, f"{role}.{key}"))  # no ep group of its own
            elif own is None:  # the reference and the critic follow the actor
                sizes.append(RoleSize(role, dim, getattr(cfg.actor, key), f"actor.{key}"))
            else:
                sizes.append(RoleSize(role, dim, own, f"{role}.{key}"))
    return sizes


def sizes_of(cfg: Config, role: str) -> dict[str, int]:
    """{tp, sp, ep} of ``role`` (sp is 1 for the rollout)."""
    found = {s.dim: s.value for s in role_sizes(cfg) if s.role == role}
    return {"tp": found.get("tp", 1), "sp": found.get("sp", 1), "ep": found.get("ep", 1)}


def kind_of(role: str) -> str:
    return ROLLOUT if role == "rollout" else TRAIN


def role_layouts(cfg: Config, train_world: int, rollout_world: int) -> RoleLayouts:
    """Each role's Layout; ValueError where the sizes do not tile (validate() reports the
    same problems with the keys first)."""

    def training(role: str) -> Layout:
        return train_layout(train_world, **sizes_of(cfg, role))

    rollout = sizes_of(cfg, "rollout")
    return RoleLayouts(
        actor=training("actor"),
        ref=training("ref"),
        critic=training("critic"),
        rollout=rollout_layout(rollout_world, tp=rollout["tp"], ep=rollout["ep"]),
    )


BACKENDS = {"cuda": ("GPU", "NCCL"), "cpu": ("CPU process", "gloo")}
"""A device kind -> what one rank is, and the collectives' library between ranks."""


def layout_line(layouts: RoleLayouts, in_use: set[str], device: str, world: int) -> str:
    """The run's layout in one line, every role in use with its TP/SP/EP/DP sizes, e.g.
    ``layout on 2 CPU processes (gloo): actor TP=2 SP=1 EP=1 DP=1 | rollout TP=2 EP=1 DP=1``."""
    rank, library = BACKENDS.get(device, (f"{device} device", "its collectives"))
    ranks = rank if world == 1 else rank + ("es" if rank.endswith("s") else "s")
    where = f"{world} {ranks}"
    parts = []
    for role in ("actor", "ref", "critic", "rollout"):
        if role not in in_use:
            continue
        layout = getattr(layouts, role)
        sp = f" SP={layout.sp}" if role != "rollout" else ""
        parts.append(f"{role} TP={layout.tp}{sp} EP={layout.ep} DP={layout.dp}")
    between = f" ({library})" if world > 1 else ""
    return f"layout on {where}{between}: {' | '.join(parts)}"
