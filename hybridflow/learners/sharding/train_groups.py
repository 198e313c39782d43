"""The process groups one rank of a training role talks over: its layout seen from that rank.

Without a layout (a ``dp_group`` or the default group) every group is that one group: data
parallelism, FSDP2 over all ranks. With a :class:`~hybridflow.parallel.RoleMesh` the data,
sharding, sequence-, tensor- and expert-parallel groups are its named dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from hybridflow.parallel import RoleMesh


def distributed_world(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (the default group if None); 1 when torch.distributed is off."""
    if not distributed_on():
        return 1
    return dist.get_world_size(group)


def distributed_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if distributed_on() else 0


@dataclass(frozen=True)
class TrainGroups:
    """One rank's groups (None: the default group for data, shard and role; no such
    parallelism for sequence, tensor and expert)."""

    mesh: RoleMesh | None
    """The role's layout; None: data parallelism over ``data``."""
    data: dist.ProcessGroup | None
    """Ranks that see different data: token counts and metrics are summed over it."""
    shard: dist.ProcessGroup | None
    """Ranks that shard the parameters (FSDP2, dp × sp) and average their gradients."""
    sequence: dist.ProcessGroup | None
    """Ulysses: the ranks that split one packed stream."""
    tensor: dist.ProcessGroup | None
    """Tensor parallelism: the ranks that split each layer (models/sharding/tensor_parallel.py)."""
    expert: dist.ProcessGroup | None
    """Expert parallelism: each rank holds E/EP experts (learners/sharding/expert_shard.py)."""
    role: dist.ProcessGroup | None
    """Every rank of the role (checkpoints, barriers, the gradient norm)."""

    @classmethod
    def of(cls, mesh: RoleMesh | None, dp_group: dist.ProcessGroup | None) -> TrainGroups:
        """From a layout, or from a data-parallel group alone (not both)."""
        if mesh is None:
            return cls(None, dp_group, dp_group, None, None, None, dp_group)
        if dp_group is not None:
            raise ValueError("give a mesh or a dp_group, not both")

        def named(name: str) -> dist.ProcessGroup | None:
            return mesh.group(name) if mesh.size(name) > 1 else None

        return cls(mesh, mesh.group("dp"), mesh.group("fsdp"), named("sp"), named("tp"),
                   named("ep"), None)  # fmt: skip

    @property
    def data_size(self) -> int:
        return distributed_world(self.data)

    @property
    def data_rank(self) -> int:
        return _rank(self.data)

    @property
    def shard_size(self) -> int:
        return distributed_world(self.shard)

    @property
    def sequence_size(self) -> int:
        return distributed_world(self.sequence) if self.sequence is not None else 1

    @property
    def tensor_size(self) -> int:
        return distributed_world(self.tensor) if self.tensor is not None else 1

    @property
    def replica(self) -> list[dist.ProcessGroup]:
        """Ranks that share their rows (one model replica split by tensor and sequence),
        innermost first: each gathers the rows the controller sent the others (shared_rows)."""
        return [group for group in (self.tensor, self.sequence) if group is not None]

    @property
    def replica_size(self) -> int:
        return self.tensor_size * self.sequence_size

    @property
    def role_rank(self) -> int:
        return _rank(self.role)


def sequence_group_of(mesh: RoleMesh | None) -> dist.ProcessGroup | None:
    """The Ulysses group of a layout; None without one (or of one rank)."""
    return mesh.group("sp") if mesh is not None and mesh.size("sp") > 1 else None
