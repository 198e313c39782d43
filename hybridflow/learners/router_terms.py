"""A mixture of experts' router losses and metrics for one micro-batch of a training step
(the actor's update and SFT share it)."""

from __future__ import annotations

import torch

from hybridflow.algos.router_losses import load_balancing_loss, router_metrics, router_z_loss
from hybridflow.learners.modules import RouterTrace


def router_terms(
    trace: RouterTrace,
    num_experts: int,
    *,
    aux_loss_coef: float,
    z_loss_coef: float,
    share: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(loss to add, mini-batch terms, token-mean metrics) of one micro-batch whose tokens are
    ``share`` of the mini-batch's (so the terms summed over micro-batches and ranks are the
    mini-batch's). A coefficient of 0 leaves its loss out."""
    logits, ids = [x for x, _ in trace], [i for _, i in trace]
    metrics = router_metrics(logits, ids, num_experts)
    loss = logits[0].new_zeros((), dtype=torch.float32)
    terms: dict[str, torch.Tensor] = {}
    if aux_loss_coef:
        aux = load_balancing_loss(logits, ids, num_experts) * share
        loss = loss + aux_loss_coef * aux
        terms["moe/aux_loss"] = aux.detach()
    if z_loss_coef:
        z_loss = router_z_loss(logits) * share
        loss = loss + z_loss_coef * z_loss
        terms["moe/z_loss"] = z_loss.detach()
    return loss, terms, metrics
