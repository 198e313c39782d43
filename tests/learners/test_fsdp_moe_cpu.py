"""Two ranks (gloo, CPU, FSDP2) shard a mixture of experts' expert tensors and give the
update of one process, routing replay and router losses included."""

import os

import pytest
import torch
from gloo_ranks import run_ranks
from learner_helpers import actor_config, make_batch, max_abs_diff, record_full_gradients
from test_moe_actor import _own_routes

from hybridflow.learners import ActorLearner
from hybridflow.models import load_model

# one micro-batch of 2 rows per rank and mini-batch: one process with micro-batches of 2 on
# the reordered batch sees the same groups of rows (the aux loss is per micro-batch)
CFG = dict(ppo_mini_batch_size=4, micro_batch_size_per_gpu=2, router_replay="rollout",
           router_z_loss_coef=1e-3, lr=1e-2)  # fmt: skip
SINGLE_PROCESS_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]


def _batch():
    batch = make_batch(seed=31)
    batch.tensors["routed_experts"] = _own_routes(load_model("tiny-moe"), batch)
    return batch


def _worker(rank: int, world: int, out_dir: str) -> None:
    actor = ActorLearner(load_model("tiny-moe"), actor_config(**CFG), total_steps=2,
                         device="cpu")  # fmt: skip
    experts = actor.model.model.layers[1].mlp.experts.gate_up_proj
    grads = record_full_gradients(actor)
    metrics = actor.update(_batch().index(list(range(4 * rank, 4 * rank + 4))))
    result = dict(
        local_experts=experts.to_local().shape[0],
        grads=grads,
        metrics=metrics,
        weights=actor.core.full_state_dict(actor.model),
    )
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_two_rank_fsdp_shards_the_experts_and_equals_one_process(tmp_path):
    run_ranks(_worker, 2, str(tmp_path))
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    single = ActorLearner(load_model("tiny-moe"), actor_config(**CFG), total_steps=2,
                          device="cpu")  # fmt: skip
    grads = record_full_gradients(single)
    metrics = single.update(_batch().index(SINGLE_PROCESS_ORDER))
    assert rank0["local_experts"] == 4  # 8 experts, half on each rank
    assert max_abs_diff(rank0["grads"][0], grads[0]) < 3e-6
    for key in ("pg_loss", "grad_norm", "moe/aux_loss", "moe/z_loss", "moe/router_entropy"):
        assert rank0["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    assert max_abs_diff(rank0["weights"], single.model.state_dict()) < 4e-2 * CFG["lr"]
