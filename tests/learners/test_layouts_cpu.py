"""Layout invariance of the learners: two gloo ranks with Ulysses SP = 2, and two with tensor
parallelism TP = 2 (each rank handed its own rows, as the controller splits a batch), compute
the log-probs, losses, gradient norm and updated weights of one process, for the actor, the
reference and the critic (fp32); one process resumes their checkpoints; a mixture of experts
under SP, also with its experts split over the SP ranks (EP = 2). Four ranks with
DP = 2 × SP = 2, DP = 2 × TP = 2 (FSDP2 over the data ranks) and SP = 2 × TP = 2 do the same
for the actor."""

import functools
import os

import pytest
import torch
from gloo_ranks import run_ranks
from learner_helpers import actor_config, make_batch, max_abs_diff, tiny_model

from hybridflow.config import CriticConfig, ModelConfig, RefConfig
from hybridflow.learners import ActorLearner, CriticLearner, RefPolicy
from hybridflow.models import load_model

CFG = dict(
    ppo_mini_batch_size=4,
    # Per-GPU budget; a micro-batch of an SP = 2 group holds twice as many tokens.
    max_tokens_per_gpu=14,
    entropy_coeff=0.01,
    use_kl_loss=True,
    lr_scheduler="cosine",
    lr_warmup_steps=1,
)
LORA = ModelConfig(path="tiny", lora_rank=4, lora_alpha=8)
MOE_CFG = dict(ppo_mini_batch_size=8, micro_batch_size_per_gpu=2, router_z_loss_coef=1e-3)
CRITIC = CriticConfig(ppo_mini_batch_size=4, micro_batch_size_per_gpu=2, lr=1e-2)
# Rank r receives rows 4r..4r+3. The replica takes each mini-batch evenly from the two
# shards, as two data-parallel ranks would: mini-batch m is rows 2m, 2m+1, 4+2m, 5+2m.
SINGLE_PROCESS_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]
REF_TOKENS = 18  # the longest sequence of the batch has 11 tokens
METRICS = ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm", "lr")


LAYOUTS = {"sp": dict(sp=2), "tp": dict(tp=2)}


def _ranks(rank: int, world: int, out_dir: str) -> None:
    from hybridflow.parallel import build_mesh, train_layout

    for name, sizes in LAYOUTS.items():
        mesh = build_mesh(train_layout(world, **sizes), "cpu")
        out = _run_layout(rank, mesh, moe=name == "sp", checkpoint=os.path.join(out_dir, name))
        torch.save(out, os.path.join(out_dir, f"{name}_rank{rank}.pt"))
    # Ulysses with expert parallelism: the SP ranks also split the experts (EP spans them)
    mesh = build_mesh(train_layout(world, sp=2, ep=2), "cpu")
    moe = ActorLearner(load_model("tiny-moe"), actor_config(**MOE_CFG), total_steps=2,
                       device="cpu", mesh=mesh)  # fmt: skip
    metrics = moe.update(make_batch(seed=21).index(list(range(4 * rank, 4 * rank + 4))))
    torch.save(metrics, os.path.join(out_dir, f"sp_ep_rank{rank}.pt"))


def _run_layout(rank, mesh, moe: bool, checkpoint: str) -> dict:
    first, second = make_batch(seed=21), make_batch(seed=22)
    shard = list(range(4 * rank, 4 * rank + 4))
    actor = ActorLearner(tiny_model(), actor_config(**CFG), total_steps=4, device="cpu",
                         mesh=mesh)  # fmt: skip
    assert actor.mini_batch_size == 4
    q_proj = actor.model.model.layers[0].self_attn.q_proj.weight  # [heads × head_dim, H]
    # TP: each rank holds its heads (no FSDP over one data rank); SP: FSDP2 over the 2 ranks
    assert q_proj.to_local().shape[0] == q_proj.shape[0] // 2
    assert actor.core.fsdp == (mesh.size("sp") == 2)
    out = {"logprobs": actor.compute_logprobs(first.index(shard), with_entropy=True).tensors}
    out["metrics1"] = actor.update(first.index(shard))
    out["weights1"] = _full_weights(actor)
    actor.save(checkpoint)  # one process resumes it below: a change of layout
    out["metrics2"] = actor.update(second.index(shard))
    out["weights2"] = _full_weights(actor)
    # The token budget is per GPU: SP = 2 packs streams of twice the budget, so an 11-token
    # sequence fits under a 9-token budget (one process and TP need the whole 18).
    budget = REF_TOKENS // mesh.size("sp")
    ref = RefPolicy(tiny_model(), RefConfig(max_tokens_per_gpu=budget), device="cpu", mesh=mesh)
    out["ref"] = ref.compute_ref_logprobs(first.index(shard))["ref_logprobs"]
    critic = CriticLearner(tiny_model(), CRITIC, total_steps=2, device="cpu", mesh=mesh)
    out["values"] = critic.compute_values(first.index(shard))["values"]
    critic_batch = first.union(_critic_inputs(first)).index(shard)
    out["critic_metrics"] = critic.update(critic_batch)
    if moe:  # tensor parallelism of expert layers and of LoRA is not built
        moe = ActorLearner(load_model("tiny-moe"), actor_config(**MOE_CFG), total_steps=2,
                           device="cpu", mesh=mesh)  # fmt: skip
        out["moe_metrics"] = moe.update(first.index(shard))
        lora = ActorLearner(tiny_model(), actor_config(**MOE_CFG), total_steps=2, device="cpu",
                            mesh=mesh, model_cfg=LORA)  # fmt: skip
        out["lora_metrics"] = lora.update(first.index(shard))
        out["lora_weights"] = {name: t.clone() for name, t in lora.hf_weights()}
    return out


def _full_weights(actor) -> dict:
    """Every rank's copy of the whole weights (full_state_dict keeps rank 0's only)."""
    return {name: tensor.clone() for name, tensor in actor.core.iter_full_tensors(actor.model)}


def _critic_inputs(batch):
    from hybridflow.protocol import Batch

    mask = batch["response_mask"]
    returns = torch.linspace(-1, 1, mask.numel()).view(mask.shape) * mask
    return Batch({"values": 0.1 * returns, "returns": returns})


@pytest.mark.slow
def test_two_rank_sequence_and_tensor_parallel_learners_equal_one_process(tmp_path, one_process):
    run_ranks(_ranks, 2, str(tmp_path))
    want = one_process()
    for name in LAYOUTS:
        rank0 = torch.load(tmp_path / f"{name}_rank0.pt", weights_only=True)
        rank1 = torch.load(tmp_path / f"{name}_rank1.pt", weights_only=True)
        _compare(rank0, rank1, want, checkpoint=tmp_path / name)
    sp_ep = torch.load(tmp_path / "sp_ep_rank0.pt", weights_only=True)
    for key, value in want["moe_metrics"].items():
        assert sp_ep[key] == pytest.approx(value, rel=1e-5, abs=1e-7), ("sp × ep", key)


@pytest.fixture(scope="module")
def one_process():
    """What one process computes, the reference of both world sizes: computed once, on the
    first call."""
    return functools.cache(_one_process)


def _one_process() -> dict:
    first, second = make_batch(seed=21), make_batch(seed=22)
    single = ActorLearner(tiny_model(), actor_config(**CFG), total_steps=4, device="cpu")
    want = {"logprobs": single.compute_logprobs(first, with_entropy=True).tensors}
    want["metrics1"] = single.update(first.index(SINGLE_PROCESS_ORDER))
    want["weights1"] = {k: v.clone() for k, v in single.model.state_dict().items()}
    want["metrics2"] = single.update(second.index(SINGLE_PROCESS_ORDER))
    want["weights2"] = single.model.state_dict()
    ref = RefPolicy(tiny_model(), RefConfig(max_tokens_per_gpu=REF_TOKENS), device="cpu")
    want["ref"] = ref.compute_ref_logprobs(first)["ref_logprobs"]
    critic = CriticLearner(tiny_model(), CRITIC, total_steps=2, device="cpu")
    want["values"] = critic.compute_values(first)["values"]
    critic_batch = first.union(_critic_inputs(first)).index(SINGLE_PROCESS_ORDER)
    want["critic_metrics"] = critic.update(critic_batch)
    moe = ActorLearner(load_model("tiny-moe"), actor_config(**MOE_CFG), total_steps=2,
                       device="cpu")  # fmt: skip
    want["moe_metrics"] = moe.update(first)
    lora = ActorLearner(tiny_model(), actor_config(**MOE_CFG), total_steps=2, device="cpu",
                        model_cfg=LORA)  # fmt: skip
    want["lora_metrics"] = lora.update(first)
    want["lora_weights"] = dict(lora.hf_weights())
    return want


def _compare(rank0: dict, rank1: dict, want: dict, checkpoint) -> None:
    # Each rank returns its own rows' log-probs, entropy, reference log-probs and values.
    for key in ("old_logprobs", "entropy"):
        got = torch.cat([rank0["logprobs"][key], rank1["logprobs"][key]])
        torch.testing.assert_close(got, want["logprobs"][key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([rank0["ref"], rank1["ref"]]), want["ref"])
    torch.testing.assert_close(torch.cat([rank0["values"], rank1["values"]]), want["values"])
    for key in ("metrics1", "metrics2"):
        for metric in METRICS:
            assert rank0[key][metric] == pytest.approx(want[key][metric], rel=1e-5, abs=1e-7), (
                key, metric)  # fmt: skip
    assert rank1["metrics1"] == rank0["metrics1"]  # every rank reports the global numbers
    # AdamW's first steps are ~lr * sign(g): coordinates whose gradient is ~0 may differ by a
    # few percent of lr (as for FSDP over two ranks); everything else agrees to rounding.
    lr = actor_config(**CFG).lr
    assert max_abs_diff(rank0["weights1"], want["weights1"]) < 2e-2 * lr
    assert max_abs_diff(rank0["weights2"], want["weights2"]) < 4e-2 * lr
    # The layout's checkpoint resumed by one process continues as the layout did.
    resumed = ActorLearner(tiny_model(seed=9), actor_config(**CFG), total_steps=4, device="cpu")
    resumed.load(checkpoint)
    second = make_batch(seed=22)
    metrics2 = resumed.update(second.index(SINGLE_PROCESS_ORDER))
    for metric in METRICS:
        assert metrics2[metric] == pytest.approx(rank0["metrics2"][metric], rel=1e-5), metric
    assert max_abs_diff(resumed.model.state_dict(), rank0["weights2"]) < 4e-2 * lr
    for key in ("vf_loss", "grad_norm"):
        got = rank0["critic_metrics"][key]
        assert got == pytest.approx(want["critic_metrics"][key], rel=1e-5), key
    # A mixture of experts under SP: the router losses and metrics see the whole stream (the
    # load-balancing loss of a micro-batch is not a sum over its rows: the group's 2-row
    # micro-batches are one process's).
    if "moe_metrics" in rank0:
        assert {k for k in want["moe_metrics"] if k.startswith("moe/")}
        for key, value in want["moe_metrics"].items():
            assert rank0["moe_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        # LoRA adapters: the same step, the same merged weights
        got, expected = rank0["lora_metrics"]["grad_norm"], want["lora_metrics"]["grad_norm"]
        assert got == pytest.approx(expected, rel=1e-5)
        assert max_abs_diff(rank0["lora_weights"], want["lora_weights"]) < 2e-2 * lr


# FSDP2 over dp × sp in each; sp2_tp2: one replica of 4 ranks (Ulysses over tensor-parallel heads)
FOUR_RANK_LAYOUTS = {"dp2_sp2": dict(sp=2), "dp2_tp2": dict(tp=2), "sp2_tp2": dict(sp=2, tp=2)}
# Each replica takes its mini-batches evenly from its ranks' shards (one row of each per
# step), so with these shards the mini-batches are rows 0, 1, 4, 5 then 2, 3, 6, 7: those of
# SINGLE_PROCESS_ORDER, and one process's reference serves both world sizes.
FOUR_RANK_SHARDS = [[0, 2], [1, 3], [4, 6], [5, 7]]


def _four_ranks(rank: int, world: int, out_dir: str) -> None:
    from hybridflow.parallel import build_mesh, train_layout

    first = make_batch(seed=21)
    shard = FOUR_RANK_SHARDS[rank]
    for name, sizes in FOUR_RANK_LAYOUTS.items():
        mesh = build_mesh(train_layout(world, **sizes), "cpu")
        actor = ActorLearner(tiny_model(), actor_config(**CFG), total_steps=4, device="cpu",
                             mesh=mesh)  # fmt: skip
        assert actor.core.fsdp and actor.mini_batch_size == 4 // mesh.size("dp")
        out = {"logprobs": actor.compute_logprobs(first.index(shard))["old_logprobs"]}
        out["metrics"] = actor.update(first.index(shard))
        out["weights"] = _full_weights(actor)
        torch.save(out, os.path.join(out_dir, f"{name}_rank{rank}.pt"))


@pytest.mark.slow
def test_four_rank_data_and_sequence_or_tensor_parallel_equal_one_process(tmp_path, one_process):
    run_ranks(_four_ranks, 4, str(tmp_path))
    rows = [row for shard in FOUR_RANK_SHARDS for row in shard]
    want = one_process()
    logprobs = want["logprobs"]["old_logprobs"][rows]
    metrics, weights = want["metrics1"], want["weights1"]
    for name in FOUR_RANK_LAYOUTS:
        ranks = [torch.load(tmp_path / f"{name}_rank{r}.pt", weights_only=True) for r in range(4)]
        got = torch.cat([r["logprobs"] for r in ranks])
        torch.testing.assert_close(
            got, logprobs, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
        for key in METRICS:
            assert ranks[3]["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), (
                name, key)  # fmt: skip
        assert max_abs_diff(ranks[0]["weights"], weights) < 2e-2 * actor_config(**CFG).lr, name
