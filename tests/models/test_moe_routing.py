"""The mixture-of-experts math: routing by hand, the grouped GEMM against literal loops, routing
replay (ids from the rollout, gate weights from the current router), packed = padded."""

import math

import pytest
import torch
from model_helpers import randomized_model, small_moe_config

from hybridflow.models.moe import (
    NO_ROUTE,
    moe_experts,
    replay_routes,
    replayed_weights,
    select_experts,
)


def test_routing_by_hand():
    # probabilities 0.1, 0.2, 0.3, 0.4: the top 2 are experts 3 and 2
    logits = torch.tensor([[math.log(1), math.log(2), math.log(3), math.log(4)]])
    ids, weights = select_experts(logits, top_k=2, norm_topk_prob=False)
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.4, 0.3]]))
    _, renormalised = select_experts(logits, top_k=2, norm_topk_prob=True)
    torch.testing.assert_close(renormalised, torch.tensor([[4 / 7, 3 / 7]]))  # 0.4/0.7, 0.3/0.7
    # replayed ids 0 and 1: their probabilities 0.1, 0.2 (renormalised 1/3, 2/3)
    replayed = replayed_weights(logits, torch.tensor([[0, 1]]), norm_topk_prob=True)
    torch.testing.assert_close(replayed, torch.tensor([[1 / 3, 2 / 3]]))


def _literal_moe(hidden, ids, weights, gate_up, down):
    """One token and one of its experts at a time."""
    inner = gate_up.shape[1] // 2
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for slot in range(ids.shape[1]):
            e = ids[t, slot]
            h = gate_up[e] @ hidden[t]
            act = torch.nn.functional.silu(h[:inner]) * h[inner:]
            out[t] += weights[t, slot] * (down[e] @ act)
    return out


def _expert_inputs(tokens=13, experts=5, hidden=8, inner=12, top_k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 4] = -10.0  # expert 4 receives no token: an empty group
    ids, weights = select_experts(logits, top_k, norm_topk_prob=False)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=g)
    down = torch.randn(experts, hidden, inner, generator=g)
    return x, ids, weights, gate_up, down


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_expert_computation_equals_the_literal_loop(backend):
    x, ids, weights, gate_up, down = _expert_inputs()
    got = moe_experts(x, ids, weights, gate_up, down, backend=backend)
    torch.testing.assert_close(got, _literal_moe(x, ids, weights, gate_up, down))


def test_grouped_gemm_gradients_equal_the_loop():
    grads = []
    for backend in ("loop", "grouped_mm"):
        x, ids, weights, gate_up, down = _expert_inputs()
        leaves = [t.requires_grad_() for t in (x, weights, gate_up, down)]
        out = moe_experts(x, ids, weights, gate_up, down, backend=backend)
        out.pow(2).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for loop_grad, grouped_grad in zip(*grads):
        torch.testing.assert_close(grouped_grad, loop_grad)


def test_grouped_gemm_in_bf16_is_close_to_fp32():
    x, ids, weights, gate_up, down = _expert_inputs(tokens=64, hidden=32, inner=16)
    exact = moe_experts(x, ids, weights, gate_up, down, backend="loop")
    half = [t.bfloat16() for t in (x, gate_up, down)]
    got = moe_experts(half[0], ids, weights, half[1], half[2], backend="grouped_mm")
    assert got.dtype == torch.bfloat16
    assert ((got.float() - exact).abs().max() / exact.abs().max()).item() < 0.02


def test_replay_with_no_route_rows_routes_those_freely():
    logits = torch.randn(4, 6)
    free_ids, free_weights = select_experts(logits, 2, norm_topk_prob=True)
    recorded = torch.tensor([[5, 0], [NO_ROUTE, NO_ROUTE], [1, 2], [NO_ROUTE, NO_ROUTE]])
    ids, weights = replay_routes(logits, recorded, 2, norm_topk_prob=True)
    assert ids[0].tolist() == [5, 0] and ids[2].tolist() == [1, 2]
    assert torch.equal(ids[1], free_ids[1]) and torch.equal(ids[3], free_ids[3])
    torch.testing.assert_close(weights[1], free_weights[1])


def _packed_inputs(vocab=97, lengths=(5, 9, 3)):
    ids = torch.randint(3, vocab, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, positions, cu_seqlens, max(lengths)


def test_replaying_the_models_own_routes_changes_nothing_and_trains_the_router():
    model = randomized_model(small_moe_config("qwen3_moe"))
    inputs = _packed_inputs()
    trace = []
    with torch.no_grad():
        free = model.forward_packed(*inputs, router_trace=trace)
    assert len(trace) == len(model.config.sparse_layer_indices()) == 2
    routes = torch.stack([ids for _, ids in trace], dim=1).to(torch.int16)  # [N, L, k]
    replayed = model.forward_packed(*inputs, routed_experts=routes)
    torch.testing.assert_close(replayed, free, rtol=0, atol=0)

    replayed.pow(2).sum().backward()
    router = model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_replayed_routes_are_the_ones_used():
    model = randomized_model(small_moe_config("mixtral"))
    inputs = _packed_inputs()
    trace = []
    with torch.no_grad():
        model.forward_packed(*inputs, router_trace=trace)
        routes = torch.stack([ids for _, ids in trace], dim=1)
        other = (routes + 1) % model.config.num_experts  # every token to different experts
        replay_trace = []
        moved = model.forward_packed(*inputs, routed_experts=other, router_trace=replay_trace)
        none = model.forward_packed(*inputs, routed_experts=torch.full_like(routes, NO_ROUTE))
        free = model.forward_packed(*inputs)
    assert torch.equal(torch.stack([ids for _, ids in replay_trace], dim=1), other)
    assert (moved - free).abs().max() > 1e-3
    torch.testing.assert_close(none, free, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_packed_equals_padded(model_type):
    model = randomized_model(small_moe_config(model_type))
    ids, positions, cu_seqlens, longest = _packed_inputs()
    with torch.no_grad():
        packed = model.forward_packed(ids, positions, cu_seqlens, longest)
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            alone = model.forward_hidden(ids[start:end][None])[0]
            torch.testing.assert_close(packed[start:end], alone, atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_keeps_gradients_and_one_trace_entry_per_layer():
    grads, inputs = [], _packed_inputs()
    for recompute in (False, True):
        model = randomized_model(small_moe_config("qwen3_moe")).train()
        model.enable_gradient_checkpointing(recompute)
        trace = []
        hidden = model.forward_packed(*inputs, router_trace=trace)
        loss = hidden.pow(2).mean() + sum(logits.pow(2).mean() for logits, _ in trace)
        loss.backward()
        assert len(trace) == 2
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert any(".mlp.gate." in name for name in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_experts_compute_in_the_autocast_dtype():
    """fp32 masters under autocast: the grouped GEMMs get bf16 operands (autocast does not
    cast torch._grouped_mm's), as a dense MLP's nn.Linear would."""
    model = randomized_model(small_moe_config("qwen3_moe"))
    block = model.model.layers[0].mlp
    x = torch.randn(7, model.config.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, logits, _ = block.forward_routed(x)
        hidden = model.forward_packed(*_packed_inputs())
    assert out.dtype == logits.dtype == torch.bfloat16
    assert hidden.dtype in (torch.bfloat16, torch.float32)
    exact, _, _ = block.forward_routed(x)
    assert (out.float() - exact).abs().max() < 0.05 * exact.abs().max()
