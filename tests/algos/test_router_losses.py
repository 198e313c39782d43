"""Router losses against transformers' formula and hand-computed values."""

import math

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from hybridflow.algos.router_losses import load_balancing_loss, router_metrics, router_z_loss
from hybridflow.models.moe import select_experts


def test_load_balancing_loss_equals_transformers():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(11, 6, generator=g, requires_grad=True) for _ in range(3)]
    ids = [select_experts(x, 2, norm_topk_prob=False)[0] for x in logits]
    ours = load_balancing_loss(logits, ids, num_experts=6)
    theirs = load_balancing_loss_func(tuple(logits), num_experts=6, top_k=2)
    torch.testing.assert_close(ours, theirs)
    ours.backward()
    assert logits[0].grad.abs().sum() > 0


def test_balanced_routing_by_hand():
    # 4 tokens, 4 experts, top-1, uniform router: f_e = 1/4, P_e = 1/4 -> loss = 4 * 4/16 = 1
    logits = [torch.zeros(4, 4)]
    ids = [torch.tensor([[0], [1], [2], [3]])]
    assert load_balancing_loss(logits, ids, 4).item() == 1.0
    # logsumexp of four zeros is log 4
    assert math.isclose(router_z_loss(logits).item(), math.log(4) ** 2, rel_tol=1e-6)
    metrics = router_metrics(logits, ids, 4)
    assert metrics["moe/expert_load_max_over_mean"].item() == 1.0
    assert math.isclose(metrics["moe/router_entropy"].item(), math.log(4), rel_tol=1e-6)


def test_collapsed_routing_metrics():
    # every token on expert 0 of 4 (top-1): max/mean = 4 / 1 = 4; one-hot router: entropy 0
    logits = [torch.tensor([[100.0, 0, 0, 0]] * 4), torch.zeros(4, 4)]
    ids = [torch.zeros(4, 1, dtype=torch.long), torch.tensor([[0], [1], [2], [3]])]
    metrics = router_metrics(logits, ids, 4)
    assert metrics["moe/expert_load_max_over_mean_worst_layer"].item() == 4.0
    assert metrics["moe/expert_load_max_over_mean"].item() == 2.5  # (4 + 1) / 2
    assert metrics["moe/router_entropy"].item() < math.log(4) / 2 + 1e-3
