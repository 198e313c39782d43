"""A replicated weight used by each tensor-parallel rank for its own heads only (qk-norm, the
gated norm of Gated DeltaNet): the forward is the weight itself, the backward sums its
gradient over the group. Kept apart from tensor_parallel.py so the norms can import it
without importing the layer plans."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def summed_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """x itself in the forward; in the backward its gradient summed over ``mesh``'s ranks:
    for a replicated tensor that each rank uses for its own heads only."""
    replicated = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return replicated.to_local(grad_placements=[Partial()])
