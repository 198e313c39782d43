"""A mixture of experts' router losses and metrics for one micro-batch of a training step
(the actor's update and SFT share it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.algos.router_losses import (
    load_balancing_from_sums,
    load_balancing_sums,
    router_metrics,
    router_z_from_sums,
    router_z_sums,
)
from hybridflow.learners.modules import RouterTrace


def router_terms(
    trace: RouterTrace,
    num_experts: int,
    *,
    aux_loss_coef: float,
    z_loss_coef: float,
    share: float,
    expert_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(loss to add, mini-batch terms, token-mean metrics) of one micro-batch whose tokens are
    ``share`` of the mini-batch's (so the terms summed over micro-batches and ranks are the
    mini-batch's). A coefficient of 0 leaves its loss out.

    expert_group: expert parallelism. The ranks of the group run their micro-batches through
    the same experts at once, and the router losses are computed over the union of those
    micro-batches (the per-expert counts, probabilities and token rows summed over the
    group), so they equal one process's losses over that union. Each rank back-propagates
    the union's loss through its own tokens, weighted by the union's share, and logs 1/EP of
    it. Without a group: the micro-batch's own tokens, as transformers' formula pools the
    tokens of one forward call."""
    logits, ids = [x for x, _ in trace], [i for _, i in trace]
    metrics = router_metrics(logits, ids, num_experts)
    loss = logits[0].new_zeros((), dtype=torch.float32)
    terms: dict[str, torch.Tensor] = {}
    if not (aux_loss_coef or z_loss_coef):
        return loss, terms, metrics
    sums = [*load_balancing_sums(logits, ids, num_experts), *router_z_sums(logits)]
    share_t = torch.tensor(share, dtype=torch.float32, device=sums[0].device)
    ranks = 1
    if expert_group is not None and dist.get_world_size(expert_group) > 1:
        ranks = dist.get_world_size(expert_group)
        *sums, share_t = group_sums([*sums, share_t], expert_group)
    counts, prob_sum, rows, squares, z_rows = sums
    if aux_loss_coef:
        aux = load_balancing_from_sums(counts, prob_sum, rows) * share_t
        loss = loss + aux_loss_coef * aux
        terms["moe/aux_loss"] = aux.detach() / ranks
    if z_loss_coef:
        z_loss = router_z_from_sums(squares, z_rows) * share_t
        loss = loss + z_loss_coef * z_loss
        terms["moe/z_loss"] = z_loss.detach() / ranks
    return loss, terms, metrics


def group_sums(values: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Each tensor summed over ``group`` (one all-reduce for all), differentiable in this
    rank's own part only: the other ranks' parts are constants here, and each rank
    back-propagates through its own."""
    flat = torch.cat([v.detach().float().reshape(-1) for v in values])
    dist.all_reduce(flat, group=group)
    out, start = [], 0
    for value in values:
        total = flat[start : start + value.numel()].view(value.shape).to(value.dtype)
        out.append(value + (total - value.detach()))
        start += value.numel()
    return out
