"""Expert parallelism in a learner: which parameters are the experts, how their gradients
are reduced, and how much of the gradient norm each rank's copy counts for.

Under a layout with ``ep`` > 1 (hybridflow/parallel/layout.py) every sparse layer keeps its
EP rank's E/EP experts (models/sharding/expert_parallel.py) as a DTensor sharded on the expert axis
over the ``ep`` group, so checkpoints, the full state dict and the weight sync see the whole
[E, ...] tensors.

The ranks of one ``expert_fsdp`` group (fsdp / ep ranks: those with the same EP index) hold
the same experts. When there are several, FSDP2 shards each ``experts`` module over that
group (:func:`shard_experts`, torchtitan's layout: the parameters become 2-D DTensors,
sharded over ``expert_fsdp`` and ``ep``), nested in the layers' FSDP2 over ``fsdp``: an
expert's weights, gradients and AdamW state are 1 / (dp × sp) a rank, like every other
parameter's. With ep = dp × sp there is one such rank and FSDP2 leaves the experts out
(``ignored_params``); :func:`reduce_expert_grads` then scales their gradients. The gradient
norm counts each expert once (optim.global_grad_norm weighs a DTensor's part by its
distinct shards).

With ``param_offload`` the experts are always an FSDP2 unit of their own, over a group of
one rank when ep = dp × sp: FSDP2's CPUOffloadPolicy then keeps a rank's expert shards, their
gradients and AdamW state on the host and copies them to the device one layer at a time, as
it does for the dense weights (a group of one gathers nothing; its reduce-scatter is the
division :func:`reduce_expert_grads` would make).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hybridflow.models.sharding.expert_parallel import (
    expert_blocks,
    keep_local_experts,
    split_tensors,
)

if TYPE_CHECKING:
    from hybridflow.parallel import RoleMesh


def distribute_experts(causal_lm: nn.Module, mesh: RoleMesh) -> list[nn.Parameter]:
    """Keep this rank's experts of every sparse layer as DTensors over the ``ep`` group
    (Shard(0) of the expert axis: their projections, GPT-OSS's biases, their LoRA factors);
    returns those parameters."""
    from torch.distributed.tensor import DTensor, Shard

    keep_local_experts(causal_lm, mesh.group("ep"))
    submesh = mesh.submesh("ep")
    params = []
    for block in expert_blocks(causal_lm):
        for module, name in split_tensors(block.experts):
            local = getattr(module, name)
            sharded = DTensor.from_local(local.detach(), submesh, [Shard(0)], run_check=False)
            param = nn.Parameter(sharded, requires_grad=local.requires_grad)
            setattr(module, name, param)
            params.append(param)
    return params


def shard_experts(causal_lm: nn.Module, mesh: RoleMesh, options: dict) -> bool:
    """FSDP2 over ``expert_fsdp`` for every sparse layer's ``experts`` module, before the
    layers are sharded over ``fsdp`` (a module already sharded is left to its own FSDP2).
    ``options``: the layers' fully_shard options (mixed precision, offload). Returns False
    (nothing done) when the group has one rank and nothing is offloaded (module docstring).

    The reduce-scatter sums the gradients over ``expert_fsdp`` and divides them by the
    ``fsdp`` size, as the other parameters' reduction over ``fsdp`` divides theirs: each rank
    back-propagated its loss times that size (learners/step.py), and an expert's gradient
    already sums its EP group's tokens (the all-to-all's backward)."""
    if mesh.size("expert_fsdp") == 1 and "offload_policy" not in options:
        return False
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    own = dict(options, mesh=mesh.submesh("expert_fsdp"))
    if "mp_policy" in own:  # the routing weights [T, k] enter in their own dtype
        policy = own["mp_policy"]
        own["mp_policy"] = MixedPrecisionPolicy(param_dtype=policy.param_dtype,
                                                reduce_dtype=policy.reduce_dtype,
                                                cast_forward_inputs=False)  # fmt: skip
    for block in expert_blocks(causal_lm):
        fully_shard(block.experts, **own)
        block.experts.set_gradient_divide_factor(float(mesh.size("fsdp")))
        # a sum, then the division: gloo has no pre-multiplied sum (NCCL's PREMUL_SUM). Not
        # on a group of one, which has no collective and where torch 2.13 would divide
        # twice (its one-rank copy divides, then the post-division again).
        if mesh.size("expert_fsdp") > 1:
            block.experts.set_force_sum_reduction_for_comms(True)
    return True


def reduce_expert_grads(params: list[nn.Parameter], shard_size: int) -> None:
    """With ep = dp × sp (one rank holds each expert, FSDP2 leaves them out): make the
    experts' gradients what FSDP makes the others'. Each rank back-propagated its loss times
    ``shard_size`` (learners/step.py) and an expert's gradient already sums the tokens of its
    whole EP group (the all-to-all's backward): divided by ``shard_size``, it is the sum over
    all ranks' losses, as for FSDP's average."""
    for param in params:
        if param.grad is not None:
            param.grad.to_local().div_(shard_size)


def check_expert_options(*, optimizer_offload: bool) -> None:
    """Options that have no expert-parallel path: the host step of one device
    (optimizer_offload); FSDP2's param_offload offloads the experts' shards."""
    if optimizer_offload:
        raise ValueError(
            "actor.optimizer_offload steps on the host on one device only: with expert "
            "parallelism use actor.param_offload (FSDP2 keeps each rank's expert shards and "
            "their AdamW state on the host)"
        )
