"""The actor with expert parallelism on gloo processes gives one process's update on the same
data: gradients, metrics (router losses pooled over the EP group) and weights, with routing
replay; the full weights (weight sync, export) and a checkpoint round trip hold all experts,
and one process loads the checkpoint.

- 2 processes, EP = 2: 4 of the tiny MoE's 8 experts per rank, FSDP2 shards the rest;
- 4 processes, EP = 2: the two ranks that hold the same 4 experts shard them with FSDP2
  (2 experts' weights a rank), nested in FSDP2 over all 4 for the rest."""

import os

import pytest
import torch
from gloo_ranks import run_ranks
from learner_helpers import actor_config, make_batch, max_abs_diff, record_full_gradients
from test_moe_actor import _own_routes

from hybridflow.config import ModelConfig
from hybridflow.learners import ActorLearner
from hybridflow.models import load_model
from hybridflow.parallel import build_mesh, train_layout

# Rank r takes rows [8r/world, 8(r+1)/world) and a mini-batch of 4 rows takes 4/world of
# them from every rank. The EP group's router losses are over the union of its ranks'
# micro-batches, so one process, walking the rows in this order with micro-batches of the
# EP group's rows, sees the same groups of rows:
# - 2 ranks (one EP group): mini-batches {0, 1, 4, 5} and {2, 3, 6, 7}, one micro-batch each;
# - 4 ranks (EP groups {0, 1} and {2, 3}): mini-batches {0, 2, 4, 6} and {1, 3, 5, 7}, with
#   micro-batches {0, 2}, {4, 6}, {1, 3}, {5, 7}.
CFG = dict(ppo_mini_batch_size=4, micro_batch_size_per_gpu=2, router_replay="rollout",
           router_z_loss_coef=1e-2, router_aux_loss_coef=0.1, lr=1e-2)  # fmt: skip
SINGLE_PROCESS = {2: ([0, 1, 4, 5, 2, 3, 6, 7], 4), 4: ([0, 2, 4, 6, 1, 3, 5, 7], 2)}


def _batch():
    batch = make_batch(seed=31)
    batch.tensors["routed_experts"] = _own_routes(load_model("tiny-moe"), batch)
    return batch


def _worker(rank: int, world: int, out_dir: str) -> None:
    mesh = build_mesh(train_layout(world, ep=2), "cpu")
    actor = ActorLearner(load_model("tiny-moe"), actor_config(**CFG), total_steps=2,
                         device="cpu", mesh=mesh)  # fmt: skip
    experts = actor.model.model.layers[1].mlp.experts.gate_up_proj
    grads = record_full_gradients(actor)
    rows = 8 // world
    metrics = actor.update(_batch().index(list(range(rows * rank, rows * rank + rows))))
    weights = {name: tensor.clone() for name, tensor in actor.hf_weights()}
    actor.save(os.path.join(out_dir, "ckpt"))
    resumed = ActorLearner(load_model("tiny-moe"), actor_config(**CFG), total_steps=2,
                           device="cpu", mesh=mesh)  # fmt: skip
    resumed.load(os.path.join(out_dir, "ckpt"))
    resumed_weights = {name: tensor.clone() for name, tensor in resumed.hf_weights()}
    result = dict(local_experts=experts.to_local().shape[0], grads=grads, metrics=metrics,
                  weights=weights, resumed_weights=resumed_weights)  # fmt: skip
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ep2_update_equals_one_process(tmp_path, world):
    run_ranks(_worker, world, str(tmp_path))
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / f"rank{world - 1}.pt", weights_only=True)
    order, micro_batch = SINGLE_PROCESS[world]
    single = ActorLearner(load_model("tiny-moe"),
                          actor_config(**dict(CFG, micro_batch_size_per_gpu=micro_batch)),
                          total_steps=2, device="cpu")  # fmt: skip
    grads = record_full_gradients(single)
    metrics = single.update(_batch().index(order))
    # 8 experts, half on each EP rank; on 4 ranks FSDP2 halves those again
    assert rank0["local_experts"] == 8 // world
    assert len(grads) == len(rank0["grads"]) == 2  # two mini-batches: two optimizer steps
    for step, step_grads in enumerate(grads):
        for name, grad in step_grads.items():
            scale = grad.abs().max().clamp(min=1e-12)
            relative = float((rank0["grads"][step][name] - grad).abs().max() / scale)
            # the second step starts from weights that Adam moved apart slightly (below)
            assert relative < (1e-4 if step == 0 else 1e-2), (step, name)
    # (router entropy and expert load are per-micro-batch means, weighted by response tokens:
    # two micro-batches of 2 rows and one of 4 weigh the same tokens differently)
    for key in ("pg_loss", "grad_norm", "moe/aux_loss", "moe/z_loss"):
        assert abs(rank0["metrics"][key] - metrics[key]) <= 1e-4 * abs(metrics[key]), key
    expected = {name: tensor for name, tensor in single.hf_weights()}
    assert rank0["weights"]["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 8
    # Adam divides by |g| + 1e-8: entries whose gradient is float noise (~1e-7, equal to
    # 1e-6 of the largest) move by a part of lr that differs between the runs; the
    # gradients above are the tight check.
    assert max_abs_diff(rank0["weights"], expected) < 0.2 * CFG["lr"]
    assert max_abs_diff(rank1["weights"], rank0["weights"]) == 0
    assert max_abs_diff(rank0["resumed_weights"], rank0["weights"]) == 0
    # the layout's checkpoint loads into one process (another layout): the same weights
    one = ActorLearner(load_model("tiny-moe"), actor_config(**CFG), total_steps=2, device="cpu")
    one.load(str(tmp_path / "ckpt"))
    assert max_abs_diff(dict(one.hf_weights()), rank0["weights"]) == 0


def _offload_worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    mesh = build_mesh(train_layout(world, ep=2), "cpu")
    result = {}
    for offload in (False, True):
        actor = ActorLearner(load_model("tiny-moe"), actor_config(**CFG, param_offload=offload),
                             total_steps=2, device="cpu", mesh=mesh)  # fmt: skip
        experts = actor.model.model.layers[1].mlp.experts
        grads = record_full_gradients(actor)
        rows = 8 // world
        metrics = actor.update(_batch().index(list(range(rows * rank, rows * rank + rows))))
        weights = {name: tensor.clone() for name, tensor in actor.hf_weights()}
        result[offload] = dict(grads=grads, metrics=metrics, weights=weights,
                               unit=isinstance(experts, FSDPModule))  # fmt: skip
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ep2_offloaded_update_equals_on_device_and_one_process(tmp_path, world):
    """actor.param_offload with EP = 2: FSDP2's CPU offload holds the experts' shards and
    their AdamW state. On 2 ranks (each expert on one rank) the experts become an FSDP2 unit
    of their own over one rank; on 4 they are one over the 2 ranks that share them. The
    update is the on-device EP run's and one process's."""
    run_ranks(_offload_worker, world, str(tmp_path))
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    on_device, offloaded = rank0[False], rank0[True]
    # on 2 ranks FSDP2 leaves the experts out unless they are offloaded
    assert on_device["unit"] == (world == 4) and offloaded["unit"]
    for step, step_grads in enumerate(on_device["grads"]):
        for name, grad in step_grads.items():
            assert torch.allclose(offloaded["grads"][step][name], grad, rtol=1e-5, atol=1e-7), name
    for key in ("pg_loss", "grad_norm", "moe/aux_loss", "moe/z_loss"):
        assert abs(offloaded["metrics"][key] - on_device["metrics"][key]) <= 1e-5 * abs(
            on_device["metrics"][key]), key  # fmt: skip
    assert max_abs_diff(offloaded["weights"], on_device["weights"]) < 1e-5
    order, micro_batch = SINGLE_PROCESS[world]
    single = ActorLearner(load_model("tiny-moe"),
                          actor_config(**dict(CFG, micro_batch_size_per_gpu=micro_batch)),
                          total_steps=2, device="cpu")  # fmt: skip
    single.update(_batch().index(order))
    # the bound of test_ep2_update_equals_one_process (Adam on float-noise gradients)
    assert max_abs_diff(offloaded["weights"], dict(single.hf_weights())) < 0.2 * CFG["lr"]


FAMILIES = ("tiny-gpt-oss", "tiny-deepseek-v3")
# LoRA on attention (GPT-OSS's biased q/k/v/o, DeepSeek's MLA projections) and every expert
FAMILY_LORA = dict(lora_rank=4, lora_alpha=8)


def _family_batch(preset: str):
    batch = make_batch(seed=31)
    batch.tensors["routed_experts"] = _own_routes(load_model(preset), batch)
    return batch


def _family_update(preset: str, rows: list[int], mesh=None, lora: bool = False,
                   checkpoint: str | None = None):  # fmt: skip
    """One update (one optimizer step) of ``preset`` on ``rows``: its gradients, metrics,
    merged HF weights, and the experts' first tensor's local expert count; ``checkpoint``:
    saved there, and the merged weights of a learner that loads it."""
    model_cfg = ModelConfig(path=preset, **FAMILY_LORA) if lora else None

    def learner():
        return ActorLearner(load_model(preset), actor_config(**CFG), total_steps=2,
                            device="cpu", mesh=mesh, model_cfg=model_cfg)  # fmt: skip

    actor = learner()
    experts = actor.model.model.layers[-1].mlp.experts.gate_up_proj
    local = experts.to_local() if hasattr(experts, "to_local") else experts
    grads = record_full_gradients(actor)
    metrics = actor.update(_family_batch(preset).index(rows))
    weights = {name: tensor.clone() for name, tensor in actor.hf_weights()}
    result = dict(grads=grads[0], metrics=metrics, weights=weights, local_experts=local.shape[0])
    if checkpoint is not None:
        actor.save(checkpoint)
        resumed = learner()
        resumed.load(checkpoint)
        result["resumed_weights"] = {name: t.clone() for name, t in resumed.hf_weights()}
    return result


def _families_worker(rank: int, world: int, out_dir: str) -> None:
    """Per family: FSDP2 over both ranks (experts sharded by FSDP2 as any weight), then
    EP = 2 (half of the experts a rank, their biases and LoRA factors with them)."""
    mesh = build_mesh(train_layout(world, ep=2), "cpu")
    rows = [2 * rank, 2 * rank + 1]  # one mini-batch of the batch's first 4 rows
    result = {}
    for preset in FAMILIES:
        result[preset, "fsdp"] = _family_update(preset, rows)
        result[preset, "ep"] = _family_update(preset, rows, mesh)
        checkpoint = os.path.join(out_dir, f"{preset}-ep-lora")
        result[preset, "ep_lora"] = _family_update(preset, rows, mesh, lora=True,
                                                   checkpoint=checkpoint)  # fmt: skip
    torch.save(result, os.path.join(out_dir, f"families{rank}.pt"))


def _assert_same_step(got: dict, want: dict, lr: float) -> None:
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        scale = grad.abs().max().clamp(min=1e-12)
        assert float((got["grads"][name] - grad).abs().max() / scale) < 1e-4, name
    for key in ("pg_loss", "grad_norm", "moe/aux_loss", "moe/z_loss"):
        assert abs(got["metrics"][key] - want["metrics"][key]) <= 1e-4 * abs(
            want["metrics"][key]), key  # fmt: skip
    assert got["weights"].keys() == want["weights"].keys()
    # the bound of test_ep2_update_equals_one_process (Adam on float-noise gradients)
    assert max_abs_diff(got["weights"], want["weights"]) < 0.2 * lr


def test_gpt_oss_and_deepseek_v3_under_fsdp2_and_ep2_equal_one_process(tmp_path):
    """GPT-OSS's biased experts (biases split with their experts, the router's bias whole)
    and DeepSeek-V3's grouped-routed experts (shared experts and the score correction whole)
    over 2 gloo ranks: the first step's gradients, the losses and the updated weights of one
    process on the same rows, with FSDP2 alone, with EP = 2, and with EP = 2 and LoRA on the
    attention projections and every expert (the exported weights merged, and a checkpoint
    of the split adapters resumes them)."""
    run_ranks(_families_worker, 2, str(tmp_path))
    rank0 = torch.load(tmp_path / "families0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "families1.pt", weights_only=True)
    order = [0, 1, 2, 3]
    for preset in FAMILIES:
        experts = load_model(preset).config.num_experts
        # the router losses pool the EP group's micro-batches, a rank's own under FSDP2 alone
        for run, micro_batch, lora in (("fsdp", 2, False), ("ep", 4, False), ("ep_lora", 4, True)):
            model_cfg = ModelConfig(path=preset, **FAMILY_LORA) if lora else None
            single = ActorLearner(load_model(preset),
                                  actor_config(**dict(CFG, micro_batch_size_per_gpu=micro_batch)),
                                  total_steps=2, device="cpu", model_cfg=model_cfg)  # fmt: skip
            grads = record_full_gradients(single)
            metrics = single.update(_family_batch(preset).index(order))
            want = dict(grads=grads[0], metrics=metrics, weights=dict(single.hf_weights()))
            _assert_same_step(rank0[preset, run], want, CFG["lr"])
            assert max_abs_diff(rank1[preset, run]["weights"], rank0[preset, run]["weights"]) == 0
            if lora:  # only adapters train; the export is plain HF names, merged
                assert all(".lora" in name for name in want["grads"])
                assert not any("lora" in name for name in want["weights"])
                # the split adapters' checkpoint resumes them
                resumed = rank0[preset, run]["resumed_weights"]
                assert max_abs_diff(resumed, rank0[preset, run]["weights"]) == 0
        assert rank0[preset, "ep"]["local_experts"] == experts // 2
        assert rank0[preset, "fsdp"]["local_experts"] == experts // 2  # FSDP2's dim-0 shard
