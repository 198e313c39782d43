"""A role's parallel layout: how its ranks split into data, sequence, tensor and expert groups.

A :class:`Layout` is a value (sizes and the order of its mesh dimensions); every question
about it (which ranks share a tensor-parallel group, where a rank sits) is a pure function
of it, answered without processes. :func:`build_mesh` turns it into a torch ``DeviceMesh``
whose named dimensions are the groups a communicating function receives. There is no
module-level process group: code that talks to other ranks is handed a :class:`RoleMesh`.

Rank order (outermost first), training roles::

    dp_mod_ep × dp_in_ep × sp × tp      (expert_parallel_size > 1)
    dp × sp × tp                        (otherwise)

Tensor parallelism is innermost, so a TP group is consecutive ranks (one NVLink island);
Ulysses SP next, so its all-to-all stays inside a node as long as tp × sp ≤ 8. Named groups:

- ``tp``: shards heads, MLP columns and the vocabulary; ``sp``: Ulysses sequence shards;
- ``dp``: ranks that see different data (world / (tp × sp));
- ``fsdp``: ranks that shard the parameters, dp × sp (SP ranks hold the same weights, so
  FSDP2 shards over them too, as verl and torchtitan do);
- ``ep``: ranks that split the experts, spanning the SP ranks and ep / sp data ranks;
  ``expert_fsdp``: the ranks that shard one expert's weights, fsdp / ep.

The rollout's order is ``dp × tp``, or ``dp_mod_ep × dp_in_ep × tp`` with expert
parallelism: an EP group spans whole TP groups (attention tensor-parallel inside a replica,
experts spread over ep / tp replicas, vLLM's expert-parallel layout).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

TRAIN, ROLLOUT = "train", "rollout"


@dataclass(frozen=True)
class Layout:
    """A role's parallel sizes over ``world`` ranks. Construct with :func:`train_layout` or
    :func:`rollout_layout`, which check the sizes; fields are plain integers."""

    kind: str
    """train (actor, reference, critic) | rollout."""
    world: int
    """Ranks of the role."""
    tp: int = 1
    """Tensor-parallel size."""
    sp: int = 1
    """Ulysses sequence-parallel size (training roles only)."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models)."""

    @property
    def dp(self) -> int:
        """Ranks that see different data: world / (tp × sp)."""
        return self.world // (self.tp * self.sp)

    @property
    def base_dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh's own dimensions, outermost first: (name, size)."""
        inner = self.sp if self.kind == TRAIN else self.tp
        if self.ep > 1:
            in_ep = self.ep // inner  # data ranks inside one expert group
            dims = [("dp_mod_ep", self.dp // in_ep), ("dp_in_ep", in_ep)]
        else:
            dims = [("dp", self.dp)]
        if self.kind == TRAIN:
            dims.append(("sp", self.sp))
        return (*dims, ("tp", self.tp))

    @property
    def named_groups(self) -> dict[str, tuple[str, ...]]:
        """Every group name and the base dimensions it spans (a row-major flattening)."""
        base = [name for name, _ in self.base_dims]
        data = ("dp_mod_ep", "dp_in_ep") if self.ep > 1 else ("dp",)
        groups = {name: (name,) for name in base}
        groups["dp"] = data
        if self.kind == TRAIN:
            groups["fsdp"] = (*data, "sp")
            if self.ep > 1:
                groups["ep"] = ("dp_in_ep", "sp")
                groups["expert_fsdp"] = ("dp_mod_ep",)
        elif self.ep > 1:
            groups["ep"] = ("dp_in_ep", "tp")
        return groups

    def size(self, group: str) -> int:
        """Ranks in one ``group`` (1 for a group this layout does not have, e.g. ``ep``)."""
        dims = dict(self.base_dims)
        spans = self.named_groups.get(group)
        return 1 if spans is None else math.prod(dims[name] for name in spans)


@dataclass(frozen=True)
class RoleLayouts:
    """The layout of every role of a run (roles.role_layouts builds it from the config;
    Derived.layouts)."""

    actor: Layout
    ref: Layout
    critic: Layout
    rollout: Layout


def layout_problems(
    kind: str, world: int, tp: int, sp: int, ep: int, labels: Mapping[str, str] | None = None
) -> list[str]:
    """Why these sizes make no layout (empty if they do). ``labels`` names each of world, tp,
    sp, ep in the sentences (the config check passes its keys); default: those letters."""
    name = {"world": "world", "tp": "tp", "sp": "sp", "ep": "ep", **(labels or {})}
    values = {"world": world, "tp": tp, "sp": sp, "ep": ep}
    problems = [f"{name[dim]} = {value} must be >= 1" for dim, value in values.items() if value < 1]
    if problems:
        return problems
    if kind == ROLLOUT and sp != 1:
        problems.append(f"{name['sp']} = {sp}: the rollout has no sequence parallelism")
    if world % (tp * sp):
        product = (f"{name['tp']} = {tp}" if kind == ROLLOUT
                   else f"{name['tp']} × {name['sp']} = {tp} × {sp}")  # fmt: skip
        problems.append(f"{name['world']} = {world} is not a multiple of {product}")
        return problems
    # An expert group spans whole SP groups (training) or whole TP replicas (rollout).
    inner, whole = ("sp", world // tp) if kind == TRAIN else ("tp", world)
    whole_name = f"{name['world']} / {name['tp']}" if kind == TRAIN else name["world"]
    if ep > 1 and (ep % values[inner] or whole % ep):
        problems.append(
            f"{name['ep']} = {ep} must be a multiple of {name[inner]} = {values[inner]} and "
            f"divide {whole_name} = {whole} (an expert group spans whole {inner} groups)"
        )
    return problems


def _make(kind: str, world: int, tp: int, sp: int, ep: int) -> Layout:
    problems = layout_problems(kind, world, tp, sp, ep)
    if problems:
        raise ValueError("; ".join(problems))
    return Layout(kind=kind, world=world, tp=tp, sp=sp, ep=ep)


def train_layout(world: int, *, tp: int = 1, sp: int = 1, ep: int = 1) -> Layout:
    """A training role's layout (actor, reference, critic); ValueError if the sizes do not
    tile ``world`` (validate() reports the same with the config keys)."""
    return _make(TRAIN, world, tp, sp, ep)


def rollout_layout(world: int, *, tp: int = 1, ep: int = 1) -> Layout:
    """The rollout's layout: ``world / tp`` engine replicas of ``tp`` ranks each."""
    return _make(ROLLOUT, world, tp, 1, ep)


# ---------------------------------------------------------------- rank arithmetic (pure)


def _strides(sizes: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return strides[::-1]


def base_coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """``rank``'s index along each base dimension (row-major, tp fastest)."""
    if not 0 <= rank < layout.world:
        raise ValueError(f"rank {rank} is outside a layout of {layout.world} ranks")
    names, sizes = zip(*layout.base_dims, strict=True)
    return {
        n: rank // s % size for n, s, size in zip(names, _strides(list(sizes)), sizes, strict=True)
    }


def coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """``rank``'s index within every named group (its rank inside that group)."""
    base, dims = base_coordinates(layout, rank), dict(layout.base_dims)
    out = {}
    for group, spans in layout.named_groups.items():
        index = 0
        for name in spans:
            index = index * dims[name] + base[name]
        out[group] = index
    return out


def group_ranks(layout: Layout, group: str) -> list[list[int]]:
    """Every ``group`` of the layout as its ranks in group order; ranks in one list share
    all the other coordinates. A group the layout lacks is one rank each."""
    spans = layout.named_groups.get(group, ())
    buckets: dict[tuple, list[int]] = {}
    for rank in range(layout.world):
        base = base_coordinates(layout, rank)
        key = tuple(index for name, index in base.items() if name not in spans)
        buckets.setdefault(key, []).append(rank)  # ranks ascend: row-major within the group
    return list(buckets.values())


def ranks_with(layout: Layout, group: str, rank: int) -> list[int]:
    """The ranks of ``rank``'s own ``group`` (itself included)."""
    return next(ranks for ranks in group_ranks(layout, group) if rank in ranks)


# ---------------------------------------------------------------- the torch mesh


@dataclass(frozen=True)
class RoleMesh:
    """A layout and its DeviceMesh: what a function that communicates receives."""

    layout: Layout
    mesh: DeviceMesh
    """The mesh over the base dimensions (``layout.base_dims``)."""
    flattened: dict[str, DeviceMesh]
    """The groups that span several base dimensions (fsdp, ep, ...), each a 1-D mesh."""

    def submesh(self, group: str) -> DeviceMesh:
        """The one-dimensional mesh of this rank's ``group`` (DTensor and FSDP2 take it)."""
        if group in self.flattened:
            return self.flattened[group]
        return self.mesh[self.layout.named_groups[group][0]]

    def group(self, group: str) -> ProcessGroup:
        """This rank's process group along ``group``."""
        return self.submesh(group).get_group()

    def size(self, group: str) -> int:
        return self.layout.size(group)

    def rank_in(self, group: str) -> int:
        """This rank's index within its ``group``."""
        return self.submesh(group).get_local_rank()


def build_mesh(layout: Layout, device_type: str) -> RoleMesh:
    """The layout's DeviceMesh over the default process group, which must span exactly
    ``layout.world`` ranks; every rank calls this (it creates the groups collectively)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != layout.world:
        raise ValueError(
            f"the layout spans {layout.world} ranks but the process group has "
            f"{dist.get_world_size()}"
        )
    names, sizes = zip(*layout.base_dims, strict=True)
    mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
    flattened = {  # torchtitan's way to name a product of dimensions
        group: mesh[spans]._flatten(group)
        for group, spans in layout.named_groups.items()
        if len(spans) > 1
    }
    return RoleMesh(layout, mesh, flattened)
