"""Experts across rollout replicas on the fused decode layers (engine/expert_spread.py with
the triton backend, layers/moe.experts_triton), gloo processes under TRITON_INTERPRET=1:
tiny-moe cut to its dense first layer and one sparse layer, fp32, std-0.3 weights. Each
replica routes its own prompt on the whole router (recorded), sends the rows to the ranks that
hold their experts by all-to-all, runs its 4 of the 8 experts on the grouped Triton kernels
(layers/moe.spread_local_experts) and combines them back: the tokens, log-probs and routing
records are one process's on the same backend. The replicas' budgets differ, so the replica
done first serves the other's rounds with zero rows on the same kernels."""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.engine import Engine, EngineOptions, SamplingParams, expert_spread
from hybridflow.engine.expert_spread import expert_parallel_model, spread_shard
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.parallel import build_mesh, rollout_layout

pytest.importorskip("triton")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernels on CPU need TRITON_INTERPRET=1")  # fmt: skip

PROMPTS = [[5, 17, 9, 33], [40, 41], [100, 3, 8], [12, 60, 7, 7, 2]]
BUDGETS = [4, 2, 3, 2]  # new tokens a prompt: replica 0 runs the most passes


def _model():
    config = dataclasses.replace(preset_config("tiny-moe"), num_hidden_layers=2)
    generator = torch.Generator().manual_seed(2)
    whole = build_model(config, seed=2).eval().requires_grad_(False)
    for name, p in whole.named_parameters():
        if not name.endswith("norm.weight"):
            p.normal_(0, 0.3, generator=generator)
    return whole


def _engine(model, weight_format: str = "model") -> Engine:
    # cuBLAS-side matmuls (torch on the CPU): the interpreter runs the row-wise and expert
    # kernels only
    options = EngineOptions(decode_backend="triton", kv_block_size=16, decode_matmul="cublas",
                            weight_format=weight_format)  # fmt: skip
    return Engine(model, max_batch_size=4, max_seq_len=32, options=options)


def _spread_engine(whole, mesh, tp: int, weight_format: str = "model") -> Engine:
    replica = mesh.group("tp") if tp > 1 else None
    shard = expert_parallel_model(whole.config, mesh.group("ep"), replica, torch.float32, "cpu")
    engine = _engine(shard, weight_format)
    ep_rank, ep, tp_rank = mesh.rank_in("ep"), mesh.size("ep"), mesh.rank_in("tp")
    engine.load_weights((name, spread_shard(name, tensor, ep_rank, ep, tp_rank, tp))
                        for name, tensor in whole.named_parameters(remove_duplicate=False))  # fmt: skip
    return engine


def _fused_on_ranks(rank: int, world: int, tp: int, weight_format: str = "model") -> None:
    """weight_format "fp8": every rank's e4m3 copies of its own experts (weight-only, the
    grouped kernels' W_FP8 mode) against the one-process fp8 engine's of all of them."""
    mesh = build_mesh(rollout_layout(world, tp=tp, ep=world), "cpu")
    whole = _model()
    engine = _spread_engine(whole, mesh, tp, weight_format)
    assert engine.spread and engine.decode_backend == "triton" and not engine.cuda_graphs
    assert engine.model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 8 // world
    assert engine.peer_experts() is not None  # peers' rows meet the grouped kernels too
    with pytest.raises(ValueError, match="cuda_graphs=True does not run experts spread"):
        Engine(engine.model, max_batch_size=4, max_seq_len=32,
               options=EngineOptions(cuda_graphs=True))  # fmt: skip
    replicas, replica = world // tp, rank // tp
    mine = list(range(replica, len(PROMPTS), replicas))  # prompt i on replica i mod replicas
    budgets = [BUDGETS[i] for i in mine]
    params = SamplingParams(temperature=0, max_new_tokens=max(budgets), ignore_eos=True)
    served = []

    def serve_peers(*args):
        served.append(real_serve(*args))
        return served[-1]

    real_serve = expert_spread.serve_peers
    with mock.patch.object(expert_spread, "serve_peers", serve_peers):
        got = engine.generate([PROMPTS[i] for i in mine], params, max_new_tokens=budgets)
    expected = _engine(whole, weight_format).generate([PROMPTS[i] for i in mine], params,
                                       max_new_tokens=budgets)  # fmt: skip
    if weight_format == "fp8":  # the copies of this rank's experts, read by its kernels
        assert engine.fp8.experts.of(1).gate_up.shape[0] == 8 // world
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [len(c.token_ids) for c in got] == budgets
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        assert a.routed_experts.tolist() == b.routed_experts.tolist()
    records = [None] * world
    dist.all_gather_object(records, [c.routed_experts.tolist() for c in got])
    assert records[rank] == records[replica * tp]  # the replica's ranks: one record
    # replica 0 runs the most passes: every other replica served its last rounds
    assert served[0] == 0 if replica == 0 else served[0] > 0
    dist.barrier()


@interpreted
def test_two_replicas_on_the_fused_layers_draw_one_process_tokens_and_routes():
    run_ranks(_fused_on_ranks, 2, 1)


@interpreted
@pytest.mark.slow
def test_two_replicas_with_fp8_experts_draw_the_tokens_of_one_fp8_process():
    run_ranks(_fused_on_ranks, 2, 1, "fp8")


@interpreted
@pytest.mark.slow
def test_tensor_parallel_replicas_on_the_fused_layers_draw_one_process_tokens_and_routes():
    """2 replicas of rollout TP 2, the experts over all 4 ranks."""
    run_ranks(_fused_on_ranks, 4, 2)


def _family_on_ranks(rank: int, world: int, family: str) -> None:
    """A family whose layers the eager passes run (MLA, Gated DeltaNet, sink attention) with
    the Triton steps of the triton backend, its sparse blocks dispatching over the group
    through the model's experts module: one process's tokens and routes on the same steps."""
    from test_expert_spread import _family_model

    mesh = build_mesh(rollout_layout(world, ep=world), "cpu")
    whole = _family_model(family)
    shard = expert_parallel_model(whole.config, mesh.group("ep"), None, torch.float32, "cpu")
    engine = _engine(shard)
    engine.load_weights((name, spread_shard(name, tensor, rank, world))
                        for name, tensor in whole.named_parameters(remove_duplicate=False))  # fmt: skip
    with torch.no_grad():  # DeepSeek's router correction bias: a buffer, whole on every rank
        buffers = dict(engine.model.named_buffers())
        for name, tensor in whole.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffers[name].copy_(tensor)
    assert engine.spread and engine.eager_layers and engine.recurrent_step == "triton"
    prompts = [PROMPTS[rank]]
    params = SamplingParams(temperature=0, max_new_tokens=3 if rank == 0 else 1, ignore_eos=True)
    got = engine.generate(prompts, params)
    expected = _engine(whole).generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        assert a.routed_experts.tolist() == b.routed_experts.tolist()
    dist.barrier()


@interpreted
@pytest.mark.parametrize("family", ["deepseek-v3", "gpt-oss", "qwen3.5-moe"])
def test_replicas_of_each_eager_family_on_the_triton_steps_draw_one_process_tokens(family):
    run_ranks(_family_on_ranks, 2, family)
