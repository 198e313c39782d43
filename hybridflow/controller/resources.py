"""Resource pools: how many worker processes a group gets, on which devices and nodes."""

from __future__ import annotations

from collections.abc import Sequence


class ResourcePool:
    """Devices for one worker group: one worker process per device.

    ``ResourcePool(gpus=[8, 8])``: 8 GPUs on each of 2 nodes (16 ranks, ordered by node).
    ``ResourcePool(cpus=2)``: 2 CPU workers (tests, CPU-only machines).
    Split placement on one node: ``ResourcePool(gpus=4)`` and ``ResourcePool(gpus=4,
    first_device=4)`` put two groups on disjoint GPUs (``local`` backend; Ray places
    groups by its own accounting). ``cpus_per_worker`` is the Ray CPU reservation.
    """

    def __init__(
        self,
        gpus: int | Sequence[int] | None = None,
        *,
        cpus: int | Sequence[int] | None = None,
        first_device: int = 0,
        cpus_per_worker: float = 1.0,
    ) -> None:
        if (gpus is None) == (cpus is None):
            raise ValueError("give exactly one of gpus=... or cpus=...")
        counts = gpus if gpus is not None else cpus
        self.per_node: tuple[int, ...] = (counts,) if isinstance(counts, int) else tuple(counts)
        if not self.per_node or any(n <= 0 for n in self.per_node):
            raise ValueError(f"every node needs at least one worker, got {list(self.per_node)}")
        self.use_gpu = gpus is not None
        self.first_device = first_device
        self.cpus_per_worker = cpus_per_worker

    @classmethod
    def default(cls) -> ResourcePool:
        """One GPU when there is one, else one CPU worker."""
        import torch

        return cls(gpus=1) if torch.cuda.is_available() else cls(cpus=1)

    @property
    def world_size(self) -> int:
        return sum(self.per_node)

    @property
    def num_nodes(self) -> int:
        return len(self.per_node)

    def device_for(self, local_rank: int) -> str:
        """Device of a worker on a single node (inprocess/local backends)."""
        return f"cuda:{self.first_device + local_rank}" if self.use_gpu else "cpu"

    def __repr__(self) -> str:
        kind = "gpus" if self.use_gpu else "cpus"
        return f"ResourcePool({kind}={list(self.per_node)}, first_device={self.first_device})"
