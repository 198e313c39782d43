"""Ulysses sequence parallelism in the learners: two gloo ranks with SP = 2 (each handed its
own rows, as the controller splits a batch) compute the log-probs, losses, gradient norm and
updated weights of one process, for the actor, the reference and the critic."""

import os

import pytest
import torch
from gloo_ranks import run_ranks
from learner_helpers import actor_config, make_batch, max_abs_diff, tiny_model

from hybridflow.config import CriticConfig, RefConfig
from hybridflow.learners import ActorLearner, CriticLearner, RefPolicy
from hybridflow.models import load_model

CFG = dict(
    ppo_mini_batch_size=4,
    # Per-rank budget; a micro-batch of the SP group holds twice as many tokens.
    max_tokens_per_gpu=14,
    entropy_coeff=0.01,
    use_kl_loss=True,
    lr_scheduler="cosine",
    lr_warmup_steps=1,
)
MOE_CFG = dict(ppo_mini_batch_size=8, micro_batch_size_per_gpu=2, router_z_loss_coef=1e-3)
CRITIC = CriticConfig(ppo_mini_batch_size=4, micro_batch_size_per_gpu=2, lr=1e-2)
# Rank r receives rows 4r..4r+3. The SP group takes each mini-batch evenly from the two
# shards, as two data-parallel ranks would: mini-batch m is rows 2m, 2m+1, 4+2m, 5+2m.
SINGLE_PROCESS_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]
METRICS = ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm", "lr")


def _ranks(rank: int, world: int, out_dir: str) -> None:
    from hybridflow.parallel import build_mesh, train_layout

    mesh = build_mesh(train_layout(world, sp=world), "cpu")
    first, second = make_batch(seed=21), make_batch(seed=22)
    shard = list(range(4 * rank, 4 * rank + 4))
    actor = ActorLearner(tiny_model(), actor_config(**CFG), total_steps=4, device="cpu",
                         mesh=mesh)  # fmt: skip
    assert actor.core.fsdp and actor.mini_batch_size == 4
    out = {"logprobs": actor.compute_logprobs(first.index(shard), with_entropy=True).tensors}
    out["metrics1"] = actor.update(first.index(shard))
    out["weights1"] = actor.core.full_state_dict(actor.model)
    out["metrics2"] = actor.update(second.index(shard))
    out["weights2"] = actor.core.full_state_dict(actor.model)
    ref = RefPolicy(tiny_model(), RefConfig(max_tokens_per_gpu=9), device="cpu", mesh=mesh)
    out["ref"] = ref.compute_ref_logprobs(first.index(shard))["ref_logprobs"]
    critic = CriticLearner(tiny_model(), CRITIC, total_steps=2, device="cpu", mesh=mesh)
    out["values"] = critic.compute_values(first.index(shard))["values"]
    critic_batch = first.union(_critic_inputs(first)).index(shard)
    out["critic_metrics"] = critic.update(critic_batch)
    moe = ActorLearner(load_model("tiny-moe"), actor_config(**MOE_CFG), total_steps=2,
                       device="cpu", mesh=mesh)  # fmt: skip
    out["moe_metrics"] = moe.update(first.index(shard))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _critic_inputs(batch):
    from hybridflow.protocol import Batch

    mask = batch["response_mask"]
    returns = torch.linspace(-1, 1, mask.numel()).view(mask.shape) * mask
    return Batch({"values": 0.1 * returns, "returns": returns})


@pytest.mark.slow
def test_two_rank_sequence_parallel_learners_equal_one_process(tmp_path):
    run_ranks(_ranks, 2, str(tmp_path))
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    first, second = make_batch(seed=21), make_batch(seed=22)

    single = ActorLearner(tiny_model(), actor_config(**CFG), total_steps=4, device="cpu")
    logprobs = single.compute_logprobs(first, with_entropy=True)
    metrics1 = single.update(first.index(SINGLE_PROCESS_ORDER))
    weights1 = {k: v.clone() for k, v in single.model.state_dict().items()}
    metrics2 = single.update(second.index(SINGLE_PROCESS_ORDER))
    weights2 = single.model.state_dict()

    # Each rank returns its own rows' log-probs and entropy.
    for key in ("old_logprobs", "entropy"):
        got = torch.cat([rank0["logprobs"][key], rank1["logprobs"][key]])
        torch.testing.assert_close(got, logprobs[key], rtol=1e-5, atol=1e-6)
    for got, want in ((rank0["metrics1"], metrics1), (rank0["metrics2"], metrics2)):
        for key in METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert rank1["metrics1"] == rank0["metrics1"]  # every rank reports the global numbers
    # AdamW's first steps are ~lr * sign(g): coordinates whose gradient is ~0 may differ by a
    # few percent of lr (as for FSDP over two ranks); everything else agrees to rounding.
    lr = actor_config(**CFG).lr
    assert max_abs_diff(rank0["weights1"], weights1) < 2e-2 * lr
    assert max_abs_diff(rank0["weights2"], weights2) < 4e-2 * lr

    # 9 tokens per rank: the SP group packs 18-token streams, so an 11-token sequence that
    # one GPU with this budget refuses fits; one process needs the group's budget.
    ref = RefPolicy(tiny_model(), RefConfig(max_tokens_per_gpu=18), device="cpu")
    want_ref = ref.compute_ref_logprobs(first)["ref_logprobs"]
    torch.testing.assert_close(torch.cat([rank0["ref"], rank1["ref"]]), want_ref)

    critic = CriticLearner(tiny_model(), CRITIC, total_steps=2, device="cpu")
    want_values = critic.compute_values(first)["values"]
    torch.testing.assert_close(torch.cat([rank0["values"], rank1["values"]]), want_values)
    critic_metrics = critic.update(first.union(_critic_inputs(first)).index(SINGLE_PROCESS_ORDER))
    for key in ("vf_loss", "grad_norm"):
        assert rank0["critic_metrics"][key] == pytest.approx(critic_metrics[key], rel=1e-5), key

    # A mixture of experts: the router losses and metrics see the whole stream (the
    # load-balancing loss of a micro-batch is not a sum over its rows: the group's 2-row
    # micro-batches are one process's).
    moe = ActorLearner(load_model("tiny-moe"), actor_config(**MOE_CFG), total_steps=2,
                       device="cpu")  # fmt: skip
    moe_metrics = moe.update(first)
    assert {k for k in moe_metrics if k.startswith("moe/")}
    for key, value in moe_metrics.items():
        assert rank0["moe_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
