"""Two ranks (gloo, CPU, FSDP2) must give the update of one process on the same data: a dense
model, and a mixture of experts whose expert tensors they shard (routing replay and router
losses included). One start-up of the two processes serves both tests."""

import os
import time

import pytest
import torch
from gloo_ranks import run_ranks
from learner_helpers import (
    actor_config,
    make_batch,
    max_abs_diff,
    record_full_gradients,
    tiny_model,
)
from test_moe_actor import _own_routes

from hybridflow.config import ModelConfig
from hybridflow.learners import ActorLearner
from hybridflow.models import load_model

CFG = dict(
    ppo_mini_batch_size=4,
    # Token budget: with seed 21 rank 0 needs 1 micro-batch per mini-batch and rank 1 needs 2,
    # so the learner's max-over-ranks count sync is exercised.
    max_tokens_per_gpu=14,
    entropy_coeff=0.01,
    use_kl_loss=True,
    lr_scheduler="cosine",
    lr_warmup_steps=1,
)
# Rank r holds rows 4r..4r+3; its mini-batch m is rows 4r+2m, 4r+2m+1. One process sees the
# same global mini-batches when the batch is reordered like this:
SINGLE_PROCESS_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]
LORA = ModelConfig(path="tiny", lora_rank=4, lora_alpha=8, gradient_checkpointing=True)
# a bf16 base beside fp32 adapters (apply_lora): FSDP2 shards units of both dtypes
LORA_BF16 = ModelConfig(path="tiny", lora_rank=4, lora_alpha=8, dtype="bfloat16")
LORA_CFG = dict(ppo_mini_batch_size=8, micro_batch_size_per_gpu=2, lr=1e-2)
# MoE: one micro-batch of 2 rows per rank and mini-batch: one process with micro-batches of 2
# on the reordered batch sees the same groups of rows (the aux loss is per micro-batch)
MOE_CFG = dict(ppo_mini_batch_size=4, micro_batch_size_per_gpu=2, router_replay="rollout",
               router_z_loss_coef=1e-3, lr=1e-2)  # fmt: skip


def _worker(rank: int, world: int, out_dir: str) -> None:
    _dense_worker(rank, out_dir)
    _moe_worker(rank, out_dir)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The directory the two ranks wrote their results to (one spawn for the module)."""
    out_dir = tmp_path_factory.mktemp("fsdp_two_ranks")
    run_ranks(_worker, 2, str(out_dir))
    return out_dir


def _dense_worker(rank: int, out_dir: str) -> None:
    first, second = make_batch(seed=21), make_batch(seed=22)
    shard = list(range(4 * rank, 4 * rank + 4))
    actor = ActorLearner(tiny_model(), actor_config(**CFG), total_steps=4, device="cpu")
    assert actor.core.fsdp and actor.mini_batch_size == 2
    grads = record_full_gradients(actor)
    logprobs = actor.compute_logprobs(first.index(shard))["old_logprobs"]
    metrics1 = actor.update(first.index(shard))
    weights1 = actor.core.full_state_dict(actor.model)
    actor.save(os.path.join(out_dir, "ckpt"))
    # The same state written in the background while the next update's collectives run
    # (the write coordinates the ranks over a gloo group of its own).
    actor.save(os.path.join(out_dir, "ckpt_background"), background=True)
    metrics2 = actor.update(second.index(shard))
    while not actor.save_finished():
        time.sleep(0.01)
    weights2 = actor.core.full_state_dict(actor.model)
    resumed_weights2, resumed_metrics2 = [], []
    for name in ("ckpt", "ckpt_background"):
        resumed = ActorLearner(tiny_model(seed=9), actor_config(**CFG), total_steps=4,
                               device="cpu")  # fmt: skip
        resumed.load(os.path.join(out_dir, name))
        resumed_metrics2.append(resumed.update(second.index(shard)))
        resumed_weights2.append(resumed.core.full_state_dict(resumed.model))
    actor.export_hf(os.path.join(out_dir, "hf"))
    # Per-unit gathers (weight sync) equal the per-tensor full state dict.
    per_unit = {name: t.clone() for name, t in actor.core.iter_unit_gathered(actor.model)}
    per_tensor = actor.core.full_state_dict(actor.model)  # collective: every rank
    # LoRA + activation checkpointing under FSDP2: merged weights after one step.
    lora_actor = ActorLearner(
        tiny_model(), actor_config(**LORA_CFG), total_steps=2, device="cpu", model_cfg=LORA
    )
    lora_metrics = lora_actor.update(first.index(shard))
    lora_weights = {n: t.clone() for n, t in lora_actor.hf_weights()}
    bf16_actor = ActorLearner(tiny_model().to(torch.bfloat16), actor_config(**LORA_CFG),
                              total_steps=2, device="cpu", model_cfg=LORA_BF16)  # fmt: skip
    bf16_dtypes = {p.dtype for p in bf16_actor.model.parameters()}
    bf16_metrics = bf16_actor.update(first.index(shard))
    bf16_weights = {n: t.clone() for n, t in bf16_actor.hf_weights()}
    result = dict(
        logprobs=logprobs,
        metrics1=metrics1,
        metrics2=metrics2,
        resumed_metrics2=resumed_metrics2,
        grads=grads,
        weights1=weights1,
        weights2=weights2,
        resumed_weights2=resumed_weights2,
        lora_metrics=lora_metrics,
        lora_weights=lora_weights,
        bf16_dtypes=bf16_dtypes,
        bf16_metrics=bf16_metrics,
        bf16_weights=bf16_weights,
        per_unit=per_unit,
        per_tensor=per_tensor,
        hf_names=[name for name, _ in actor.hf_weights()],
    )
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_two_rank_fsdp_update_equals_single_process(two_ranks):
    rank0 = torch.load(two_ranks / "rank0.pt", weights_only=True)
    rank1 = torch.load(two_ranks / "rank1.pt", weights_only=True)

    first, second = make_batch(seed=21), make_batch(seed=22)
    single = ActorLearner(tiny_model(), actor_config(**CFG), total_steps=4, device="cpu")
    grads = record_full_gradients(single)
    logprobs = single.compute_logprobs(first)["old_logprobs"]
    metrics1 = single.update(first.index(SINGLE_PROCESS_ORDER))
    weights1 = {k: v.clone() for k, v in single.model.state_dict().items()}
    metrics2 = single.update(second.index(SINGLE_PROCESS_ORDER))
    weights2 = single.model.state_dict()

    # Log-probs: each rank's shard equals the single-process rows.
    torch.testing.assert_close(torch.cat([rank0["logprobs"], rank1["logprobs"]]), logprobs)
    # Gradient of the first optimizer step (same starting weights): equal up to the fp32
    # summation order over ranks (largest entries ~0.5; measured 9e-7).
    assert len(rank0["grads"]) == len(grads) == 4
    assert max_abs_diff(rank0["grads"][0], grads[0]) < 3e-6
    # Losses and norms of the whole mini-batch, reduced over ranks.
    for got, want in ((rank0["metrics1"], metrics1), (rank0["metrics2"], metrics2)):
        for key in ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert rank1["metrics1"] == rank0["metrics1"]  # every rank reports the global numbers
    # Weights after AdamW: Adam's first steps are ~lr * sign(g), so coordinates whose gradient
    # is ~0 may differ by a few percent of lr; everything else agrees to rounding.
    lr = actor_config(**CFG).lr
    assert max_abs_diff(rank0["weights1"], weights1) < 2e-2 * lr
    assert max_abs_diff(rank0["weights2"], weights2) < 4e-2 * lr
    # Sharded save -> load -> continue is bit-exact on the same world size.
    for resumed_weights2, resumed_metrics2 in zip(rank0["resumed_weights2"],
                                                  rank0["resumed_metrics2"]):  # fmt: skip
        assert max_abs_diff(resumed_weights2, rank0["weights2"]) == 0.0
        assert resumed_metrics2 == rank0["metrics2"]
    # LoRA (seeded adapters, same on every rank) with activation checkpointing.
    lora_single = ActorLearner(
        tiny_model(), actor_config(**LORA_CFG), total_steps=2, device="cpu", model_cfg=LORA
    )
    lora_metrics = lora_single.update(first)
    assert rank0["lora_metrics"]["grad_norm"] == pytest.approx(lora_metrics["grad_norm"], rel=1e-5)
    lora_weights = dict(lora_single.hf_weights())
    assert max_abs_diff(rank0["lora_weights"], lora_weights) < 2e-2 * LORA_CFG["lr"]
    assert (
        max_abs_diff(
            lora_weights,
            dict(
                ActorLearner(tiny_model(), actor_config(), total_steps=1, device="cpu").hf_weights()
            ),
        )
        > 1e-3
    )
    # The same with a bf16 base and fp32 adapters: the step of one process, to bf16 rounding.
    assert rank0["bf16_dtypes"] == {torch.bfloat16, torch.float32}
    bf16_single = ActorLearner(tiny_model().to(torch.bfloat16), actor_config(**LORA_CFG),
                               total_steps=2, device="cpu", model_cfg=LORA_BF16)  # fmt: skip
    bf16_metrics = bf16_single.update(first)
    assert rank0["bf16_metrics"]["grad_norm"] == pytest.approx(bf16_metrics["grad_norm"], rel=1e-5)
    bf16_weights = dict(bf16_single.hf_weights())
    assert max_abs_diff(rank0["bf16_weights"], bf16_weights) < 2e-2 * LORA_CFG["lr"]
    assert max_abs_diff(bf16_weights, {n: t.to(torch.bfloat16) for n, t in ActorLearner(
        tiny_model(), actor_config(), total_steps=1, device="cpu").hf_weights()}) > 1e-3  # fmt: skip
    # Weight sync gathers one FSDP unit at a time: same names and values as per tensor.
    assert rank0["per_unit"].keys() == rank0["per_tensor"].keys()
    assert max_abs_diff(rank0["per_unit"], rank0["per_tensor"]) == 0.0
    assert max_abs_diff(rank1["per_unit"], rank0["per_tensor"]) == 0.0
    tied = tiny_model().config.tie_word_embeddings
    assert set(rank0["hf_names"]) == set(rank0["per_tensor"]) - (
        {"lm_head.weight"} if tied else set()
    )
    # Export on rank 0 holds the trained full weights in HF layout.
    exported = load_model(str(two_ranks / "hf")).state_dict()
    assert max_abs_diff(exported, rank0["weights2"]) == 0.0


def _moe_batch():
    batch = make_batch(seed=31)
    batch.tensors["routed_experts"] = _own_routes(load_model("tiny-moe"), batch)
    return batch


def _moe_worker(rank: int, out_dir: str) -> None:
    actor = ActorLearner(load_model("tiny-moe"), actor_config(**MOE_CFG), total_steps=2,
                         device="cpu")  # fmt: skip
    experts = actor.model.model.layers[1].mlp.experts.gate_up_proj
    grads = record_full_gradients(actor)
    metrics = actor.update(_moe_batch().index(list(range(4 * rank, 4 * rank + 4))))
    result = dict(
        local_experts=experts.to_local().shape[0],
        grads=grads,
        metrics=metrics,
        weights=actor.core.full_state_dict(actor.model),
    )
    torch.save(result, os.path.join(out_dir, f"moe_rank{rank}.pt"))


@pytest.mark.slow
def test_two_rank_fsdp_shards_the_experts_and_equals_one_process(two_ranks):
    rank0 = torch.load(two_ranks / "moe_rank0.pt", weights_only=True)
    single = ActorLearner(load_model("tiny-moe"), actor_config(**MOE_CFG), total_steps=2,
                          device="cpu")  # fmt: skip
    grads = record_full_gradients(single)
    metrics = single.update(_moe_batch().index(SINGLE_PROCESS_ORDER))
    assert rank0["local_experts"] == 4  # 8 experts, half on each rank
    assert max_abs_diff(rank0["grads"][0], grads[0]) < 3e-6
    for key in ("pg_loss", "grad_norm", "moe/aux_loss", "moe/z_loss", "moe/router_entropy"):
        assert rank0["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    assert max_abs_diff(rank0["weights"], single.model.state_dict()) < 4e-2 * MOE_CFG["lr"]
