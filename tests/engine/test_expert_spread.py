"""Experts across rollout replicas (engine/expert_spread.py) on gloo processes, tiny-moe
(and tiny-deepseek-v3) in fp32 on the CPU: attention data-parallel over the replicas (each generates its own prompts,
with budgets that differ, so the replicas run different numbers of passes), every sparse
layer's 8 experts spread over all ranks and the tokens dispatched and combined by
all-to-all. The tokens and routing records are one process's (greedy, and sampled with the
split call's sample indices); the ranks of a tensor-parallel replica write the same
record."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from test_moe_tensor_parallel import PROMPTS, _engine, _gathered, _model

from hybridflow.engine import SamplingParams
from hybridflow.engine.expert_spread import expert_parallel_model, spread_of, spread_shard
from hybridflow.parallel import build_mesh, rollout_layout
from hybridflow.parallel.blocks import deltanet_sections

BUDGETS = [3, 9, 6, 12]  # new tokens a prompt: the replicas end at different passes


def _spread_engine(whole_model, mesh, tp: int):
    replica = mesh.group("tp") if tp > 1 else None
    shard = expert_parallel_model(whole_model.config, mesh.group("ep"), replica, torch.float32,
                                  "cpu")  # fmt: skip
    engine = _engine(shard, 16)
    ep_rank, ep = mesh.rank_in("ep"), mesh.size("ep")
    tp_rank, sections = mesh.rank_in("tp"), deltanet_sections(whole_model.config)
    engine.load_weights((name, spread_shard(name, tensor, ep_rank, ep, tp_rank, tp, sections))
                        for name, tensor in whole_model.named_parameters(remove_duplicate=False))  # fmt: skip
    with torch.no_grad():  # DeepSeek's router correction bias: a buffer, whole on every rank
        buffers = dict(engine.model.named_buffers())
        for name, tensor in whole_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffers[name].copy_(tensor)
    return engine


def _generate_on_ranks(rank: int, world: int, tp: int) -> None:
    mesh = build_mesh(rollout_layout(world, tp=tp, ep=world), "cpu")
    whole_model = _model()
    engine = _spread_engine(whole_model, mesh, tp)
    assert engine.spread and engine.decode_backend == "torch" and not engine.cuda_graphs
    experts = engine.model.model.layers[1].mlp.experts.gate_up_proj
    assert experts.shape[0] == 8 // world  # no rank holds every expert
    torch.testing.assert_close(
        experts, whole_model.model.layers[1].mlp.experts.gate_up_proj[
            rank * experts.shape[0] : (rank + 1) * experts.shape[0]])  # fmt: skip
    replicas, replica = world // tp, rank // tp
    mine = list(range(replica, len(PROMPTS), replicas))  # prompt i on replica i mod replicas
    whole = _engine(whole_model, 16)
    for params in (SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True),
                   SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=7,
                                  ignore_eos=True)):  # fmt: skip
        n = params.n
        budgets = [BUDGETS[i] for i in mine for _ in range(n)]
        got = engine.generate([PROMPTS[i] for i in mine], params, max_new_tokens=budgets,
                              sample_index=[i * n for i in mine] if params.seed else None)  # fmt: skip
        expected = whole.generate(PROMPTS, params,
                                  max_new_tokens=[b for b in BUDGETS for _ in range(n)])  # fmt: skip
        expected = [expected[i * n + j] for i in mine for j in range(n)]
        assert [len(c.token_ids) for c in got] == budgets
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        for a, b in zip(got, expected):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                       rtol=1e-4, atol=1e-5)  # fmt: skip
            assert np.array_equal(a.routed_experts, b.routed_experts)
        records = _gathered([c.routed_experts.tolist() for c in got])
        assert records[rank] == records[replica * tp]  # the replica's ranks: one record
    dist.barrier()


def test_spread_shard_splits_experts_by_ep_and_the_rest_by_tp():
    full = torch.arange(8 * 6 * 4).view(8, 6, 4)
    part = spread_shard("model.layers.1.mlp.experts.gate_up_proj", full, 1, 4)
    assert torch.equal(part, full[2:4])
    router = full[0]
    assert spread_shard("model.layers.1.mlp.gate.weight", router, 1, 4) is router
    q = torch.arange(8 * 4).view(8, 4)
    assert torch.equal(spread_shard("model.layers.0.self_attn.q_proj.weight", q, 1, 4, 1, 2), q[4:])


def test_a_whole_model_has_no_spread():
    assert spread_of(_model()) is None


def test_two_replicas_of_one_rank_draw_one_process_tokens_and_routes():
    run_ranks(_generate_on_ranks, 2, 1)


@pytest.mark.slow
def test_two_tensor_parallel_replicas_draw_one_process_tokens_and_routes():
    run_ranks(_generate_on_ranks, 4, 2)


def _family_model(family: str):
    """A tiny model of ``family`` with std-0.1 weights (fp32; biases too, so that GPT-OSS's
    expert biases must travel with their experts): routers far from ties."""
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    if family == "qwen3.5-moe":  # Gated DeltaNet and gated attention, a gated shared expert
        config = preset_config("tiny-hybrid").replace(
            model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True)  # fmt: skip
    else:
        config = preset_config(f"tiny-{family}")
    model = build_model(config, seed=4).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(4)
    for name, p in model.named_parameters():
        if family != "deepseek-v3" and not name.endswith("norm.weight"):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _family_on_ranks(rank: int, world: int, tp: int, family: str) -> None:
    """One family's sparse blocks with the experts over all ranks: tiny-deepseek-v3 (MLA,
    grouped routing, a shared expert: its self-routed blocks run their own experts module,
    which dispatches over the group with the spread's rounds), tiny-gpt-oss (sink attention,
    a router with a bias, experts with biases and the clamped SwiGLU) and a tiny Qwen3.5-MoE
    (Gated DeltaNet, a gated shared expert); in tensor-parallel replicas their attention
    splits by heads and the shared experts by columns (engine/tensor_parallel.py)."""
    mesh = build_mesh(rollout_layout(world, tp=tp, ep=world), "cpu")
    whole_model = _family_model(family)
    engine = _spread_engine(whole_model, mesh, tp)
    assert engine.spread and engine.native and engine.tensor_parallel == tp
    sparse = next(layer.mlp for layer in engine.model.model.layers if layer.sparse)
    share = whole_model.config.num_experts // world
    for name, tensor in sparse.experts.named_parameters():
        assert tensor.shape[0] == share, name  # GPT-OSS's biases: with their experts
    replicas, replica = world // tp, rank // tp
    mine = list(range(replica, len(PROMPTS), replicas))
    budget = 12 if replica == 0 else 5  # the replicas end at different steps
    params = SamplingParams(temperature=0, max_new_tokens=budget, ignore_eos=True)
    got = engine.generate([PROMPTS[i] for i in mine], params)
    expected = _engine(whole_model, 16).generate([PROMPTS[i] for i in mine], params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert all(len(c.token_ids) == budget for c in got)
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        assert np.array_equal(a.routed_experts, b.routed_experts)
    records = _gathered([c.routed_experts.tolist() for c in got])
    assert records[rank] == records[replica * tp]  # the replica's ranks: one record
    dist.barrier()


@pytest.mark.parametrize("family", ["deepseek-v3", "gpt-oss", "qwen3.5-moe"])
def test_replicas_of_each_family_draw_one_process_tokens_and_routes(family):
    run_ranks(_family_on_ranks, 2, 1, family)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek-v3", "gpt-oss", "qwen3.5-moe"])
def test_tensor_parallel_replicas_of_each_family_draw_one_process_tokens_and_routes(family):
    """2 replicas of rollout TP 2, the experts over all 4 ranks (rollout ep 4)."""
    run_ranks(_family_on_ranks, 4, 2, family)
