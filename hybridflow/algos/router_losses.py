"""Mixture-of-experts router losses and metrics, from one forward's routing.

Each function takes the per-sparse-layer router logits ``[N, E]`` and chosen expert ids
``[N, k]`` of the same N tokens (models/llama.py's router trace) and returns tensors.
"""

from __future__ import annotations

import torch


def load_balancing_loss(
    router_logits: list[torch.Tensor], topk_ids: list[torch.Tensor], num_experts: int
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (arXiv:2101.03961, eqs. 4-6) as transformers
    computes it (``load_balancing_loss_func``): the tokens of all layers pooled, f_e = top-k
    assignments to expert e per token, P_e = mean router probability of e, loss = E * sum_e
    f_e * P_e. Uniform routing gives k; only P_e carries a gradient.

    transformers pools the tokens of one forward call: the batch a process feeds its model
    (one micro-batch of one rank under data parallelism)."""
    counts, prob_sum, rows = load_balancing_sums(router_logits, topk_ids, num_experts)
    return load_balancing_from_sums(counts, prob_sum, rows)


def load_balancing_sums(
    router_logits: list[torch.Tensor], topk_ids: list[torch.Tensor], num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`load_balancing_loss` pools, as sums that add over ranks: (assignments per
    expert [E], router probability per expert [E] (differentiable), token rows (scalar)),
    over all layers."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros_like(counts)
    rows = 0
    for logits, ids in zip(router_logits, topk_ids):
        counts = counts + torch.zeros_like(counts).index_add_(
            0, ids.reshape(-1), torch.ones(ids.numel(), device=counts.device)
        )
        prob_sum = prob_sum + torch.softmax(logits.float(), dim=-1).sum(dim=0)
        rows += logits.shape[0]
    return counts, prob_sum, torch.tensor(float(rows), device=device)


def load_balancing_from_sums(
    counts: torch.Tensor, prob_sum: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """E * sum_e (counts_e / rows) * (prob_sum_e / rows) (see :func:`load_balancing_sums`)."""
    rows = rows.clamp(min=1.0)
    return counts.numel() * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(router_logits: list[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's z-loss (arXiv:2202.08906, eq. 5): mean over tokens of logsumexp(logits)^2,
    averaged over layers; it keeps the router logits small (bf16-safe)."""
    squares, rows = router_z_sums(router_logits)
    return router_z_from_sums(squares, rows)


def router_z_sums(router_logits: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over tokens of logsumexp(logits)^2 per layer [L] (differentiable), tokens per
    layer (scalar)): sums that add over ranks."""
    squares = torch.stack([torch.logsumexp(x.float(), dim=-1).pow(2).sum() for x in router_logits])
    return squares, torch.tensor(float(router_logits[0].shape[0]), device=squares.device)


def router_z_from_sums(squares: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return (squares / rows.clamp(min=1.0)).mean()


def router_metrics(
    router_logits: list[torch.Tensor], topk_ids: list[torch.Tensor], num_experts: int
) -> dict[str, torch.Tensor]:
    """Per-step health of the routing, summarised over layers (no gradient):

    - ``moe/expert_load_max_over_mean``: tokens of the busiest expert over the mean per
      expert (1 = balanced, E/k = every token on the same experts), averaged over layers;
      ``.._worst_layer``: its largest layer.
    - ``moe/router_entropy``: entropy of the router's softmax (nats; log E = uniform), mean
      over tokens and layers."""
    with torch.no_grad():
        ratios, entropies = [], []
        for logits, ids in zip(router_logits, topk_ids):
            counts = torch.zeros(num_experts, device=ids.device).index_add_(
                0, ids.reshape(-1), torch.ones(ids.numel(), device=ids.device)
            )
            ratios.append(counts.max() / counts.mean().clamp(min=1e-9))
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            entropies.append(-(log_probs.exp() * log_probs).sum(dim=-1).mean())
        ratio = torch.stack(ratios)
        return {
            "moe/expert_load_max_over_mean": ratio.mean(),
            "moe/expert_load_max_over_mean_worst_layer": ratio.max(),
            "moe/router_entropy": torch.stack(entropies).mean(),
        }
