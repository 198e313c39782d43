"""The actor on a mixture of experts: routing replay in the old-log-prob and update passes,
the router losses and metrics of an update."""

import pytest
import torch
from learner_helpers import actor_config, make_batch

from hybridflow.learners import ActorLearner
from hybridflow.learners.packing import pack_rows
from hybridflow.models import load_model
from hybridflow.models.moe import NO_ROUTE


def _actor(**cfg):
    return ActorLearner(load_model("tiny-moe"), actor_config(**cfg), total_steps=2, device="cpu")


def _own_routes(model, batch) -> torch.Tensor:
    """routed_experts [B, P+R, L, k] int16 of the model's own routing, NO_ROUTE on padding."""
    mask = batch["attention_mask"]
    packed = pack_rows(batch["prompts"], batch["responses"], mask)
    trace = []
    with torch.no_grad():
        model.forward_packed(
            packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen,
            router_trace=trace,
        )  # fmt: skip
    ids = torch.stack([layer_ids for _, layer_ids in trace], dim=1)  # [N, L, k]
    routes = torch.full((*mask.shape, *ids.shape[1:]), NO_ROUTE, dtype=torch.int16)
    routes[mask.bool()] = ids.to(torch.int16)
    return routes


def test_replaying_own_routes_keeps_logprobs_and_other_routes_move_them():
    batch = make_batch(seed=3)
    actor = _actor(router_replay="rollout")
    with pytest.raises(KeyError, match="routed_experts"):  # replay on, nothing recorded
        actor.compute_logprobs(batch)
    free = _actor().compute_logprobs(batch)["old_logprobs"]
    batch.tensors["routed_experts"] = _own_routes(actor.model, batch)
    replayed = actor.compute_logprobs(batch)["old_logprobs"]
    torch.testing.assert_close(replayed, free, rtol=0, atol=0)

    routes = batch.tensors["routed_experts"]
    experts = actor.model.config.num_experts
    batch.tensors["routed_experts"] = torch.where(routes >= 0, (routes + 1) % experts, routes)
    moved = actor.compute_logprobs(batch)["old_logprobs"]
    assert (moved - free).abs().max() > 1e-4
    # with replay off the recorded routes are not read
    off = _actor().compute_logprobs(batch)["old_logprobs"]
    torch.testing.assert_close(off, free, rtol=0, atol=0)


def test_update_with_replay_trains_the_router_and_logs_router_metrics():
    batch = make_batch(seed=4)
    actor = _actor(router_replay="rollout", router_z_loss_coef=1e-3)
    batch.tensors["routed_experts"] = _own_routes(actor.model, batch)
    router = actor.model.model.layers[1].mlp.gate.weight
    before = router.detach().clone()
    metrics = actor.update(batch)
    assert not torch.equal(router.detach(), before)
    # the tiny preset's config.json coefficient (0.001) applies: the loss is about k = 2
    assert actor.router_aux_loss_coef == 0.001
    assert 1.0 < metrics["moe/aux_loss"] < 4.0
    assert metrics["moe/z_loss"] > 0
    assert 1.0 <= metrics["moe/expert_load_max_over_mean"] <= 4.0  # E / k = 4 at worst
    assert 0 < metrics["moe/router_entropy"] <= torch.log(torch.tensor(8.0)).item()
    assert metrics["moe/replayed_token_fraction"] == 1.0  # every real token has its route


def test_aux_loss_coefficient_is_overridable_and_zero_turns_it_off():
    actor = _actor(router_aux_loss_coef=0.0)
    metrics = actor.update(make_batch(seed=5))
    assert "moe/aux_loss" not in metrics and "moe/router_entropy" in metrics


def test_replay_on_a_dense_model_says_it_has_no_effect(capsys):
    batch = make_batch(seed=7)
    dense = ActorLearner(load_model("tiny"), actor_config(router_replay="rollout"),
                         total_steps=1, device="cpu")  # fmt: skip
    assert "has no effect" in capsys.readouterr().err
    assert not dense.policy.replay_routes
    dense.compute_logprobs(batch)  # no routed_experts needed
