"""Expert parallelism in a learner: which parameters are the experts, how their gradients
are reduced, and how much of the gradient norm each rank's copy counts for.

Under a layout with ``ep`` > 1 (hybridflow/parallel/layout.py) every sparse layer keeps its
EP rank's E/EP experts (models/expert_parallel.py) as a DTensor sharded on the expert axis
over the ``ep`` group, so checkpoints, the full state dict and the weight sync see the whole
[E, ...] tensors. FSDP2 leaves these parameters out (``ignored_params``): it shards the rest
over ``fsdp``. The ranks of one ``expert_fsdp`` group (the ranks with the same EP index)
hold the same experts as replicas, and their gradients are summed over that group here;
the gradient norm counts each expert once (optim.global_grad_norm weighs a DTensor's part by
its distinct shards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from hybridflow.models.expert_parallel import keep_local_experts
from hybridflow.models.moe import SparseMoeBlock

if TYPE_CHECKING:
    from hybridflow.parallel import RoleMesh


def distribute_experts(causal_lm: nn.Module, mesh: RoleMesh) -> list[nn.Parameter]:
    """Keep this rank's experts of every sparse layer as DTensors over the ``ep`` group
    (Shard(0) of the expert axis); returns those parameters."""
    from torch.distributed.tensor import DTensor, Shard

    keep_local_experts(causal_lm, mesh.group("ep"))
    submesh = mesh.submesh("ep")
    params = []
    for block in causal_lm.modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(block.experts, name)
            sharded = DTensor.from_local(local.detach(), submesh, [Shard(0)], run_check=False)
            param = nn.Parameter(sharded, requires_grad=local.requires_grad)
            setattr(block.experts, name, param)
            params.append(param)
    return params


def reduce_expert_grads(
    params: list[nn.Parameter], replica_group: dist.ProcessGroup | None, shard_size: int
) -> None:
    """Make the experts' gradients what FSDP makes the others': each rank back-propagated its
    loss times ``shard_size`` (learners/step.py), and an expert's gradient already sums the
    tokens of its whole EP group (the all-to-all's backward). Summed over the replicas and
    divided by ``shard_size``, it is the sum over all ranks' losses, as for FSDP's average."""
    for param in params:
        if param.grad is None:
            continue
        local = param.grad.to_local()
        if replica_group is not None and dist.get_world_size(replica_group) > 1:
            dist.all_reduce(local, group=replica_group)
        local.div_(shard_size)


def check_expert_options(*, optimizer_offload: bool, param_offload: bool) -> None:
    """Options that have no expert-parallel path yet."""
    if optimizer_offload or param_offload:
        raise ValueError(
            "actor.param_offload and actor.optimizer_offload are not supported with expert "
            "parallelism: set them to false or expert_parallel_size=1"
        )
