"""The tensor-parallel engine on a mixture-of-experts model, 2 gloo processes (tiny-moe: a
dense first layer, then sparse ones; fp32 CPU). Attention and the dense MLP are split by
heads and columns; each sparse layer routes every token with the whole router, runs the
rank's own experts (rank r: experts [4r, 4r + 4) of 8) and one all-reduce sums them. Both
ranks draw exactly the tokens and the routing record one process with the whole model draws,
with log-probs equal to rounding; with the experts held whole on every rank, likewise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.tensor_parallel import (
    local_architecture,
    local_shard,
    splits_experts,
    tensor_parallel_model,
)
from hybridflow.models import build_model
from hybridflow.models.moe import moe_experts, select_experts
from hybridflow.models.presets import preset_config

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12]]


def test_a_share_of_the_experts_sums_to_the_whole_layer():
    """moe_experts over experts [0, 4) plus over [4, 8) is the layer over all 8: a pair
    routed to the other half adds exactly zero (rounding: the sum's order differs)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=generator)
    gate_up = torch.randn(8, 2 * 12, 16, generator=generator)
    down = torch.randn(8, 16, 12, generator=generator)
    ids, weights = select_experts(torch.randn(7, 8, generator=generator), 2, True)
    whole = moe_experts(hidden, ids, weights, gate_up, down, "loop")
    halves = [moe_experts(hidden, ids, weights, gate_up[s], down[s], "loop", first_expert=s.start)
              for s in (slice(0, 4), slice(4, 8))]  # fmt: skip
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-5, atol=1e-5)
    none_here = moe_experts(hidden, ids, weights, gate_up[:4], down[:4], "loop", first_expert=8)
    assert torch.equal(none_here, torch.zeros_like(whole))


def test_local_shape_keeps_the_router_and_expert_width_whole():
    local = local_architecture(preset_config("tiny-moe"), 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert (local.intermediate_size, local.num_experts, local.moe_intermediate_size) == (
        192, 8, 128)  # fmt: skip
    with pytest.raises(ValueError, match="num_experts = 8"):
        local_architecture(preset_config("tiny-moe"), 3, split_experts=True)


def _model():
    """tiny-moe with std-0.3 weights: peaked logits and routers far from ties."""
    generator = torch.Generator().manual_seed(2)
    model = build_model(preset_config("tiny-moe"), seed=2).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            p.normal_(0, 0.3, generator=generator)
    return model


def _engine(model, block_size):
    options = EngineOptions(kv_block_size=block_size, decode_backend="torch")
    return Engine(model, max_batch_size=8, max_seq_len=64, options=options)


def _tensor_parallel_engine(whole, split_experts: bool, block_size):
    rank, size = dist.get_rank(), dist.get_world_size()
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, torch.float32, "cpu",
                                  split_experts=split_experts)  # fmt: skip
    engine = _engine(shard, block_size)
    engine.load_weights((name, local_shard(name, tensor, rank, size, split_experts))
                        for name, tensor in whole.named_parameters(remove_duplicate=False))  # fmt: skip
    return engine


def _gathered(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _compare(whole, tp, params) -> None:
    expected = whole.generate(PROMPTS, params)
    got = tp.generate(PROMPTS, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert sum(len(c.token_ids) for c in got) > len(got)
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        assert a.routed_experts.shape == b.routed_experts.shape
        assert np.array_equal(a.routed_experts, b.routed_experts)
    records = _gathered([c.routed_experts.tolist() for c in got])
    assert all(r == records[0] for r in records)  # the same record on every rank


def _generate_on_ranks(rank: int, world: int) -> None:
    whole_model = _model()
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7, ignore_eos=True)
    # split experts on a paged cache and a slot cache, whole experts on a paged one
    for split_experts, block_size, params in ((True, 16, sampled), (True, None, greedy),
                                              (False, 16, greedy)):  # fmt: skip
        whole = _engine(whole_model, block_size)
        tp = _tensor_parallel_engine(whole_model, split_experts, block_size)
        assert tp.tensor_parallel == 2 and splits_experts(tp.model) == split_experts
        experts = tp.model.model.layers[1].mlp.experts.gate_up_proj
        assert experts.shape[0] == (4 if split_experts else 8)  # no rank holds all 8 when split
        if split_experts:
            torch.testing.assert_close(
                experts,
                whole_model.model.layers[1].mlp.experts.gate_up_proj[4 * rank : 4 * rank + 4],
            )
        _compare(whole, tp, params)


@pytest.mark.slow
def test_two_ranks_draw_the_tokens_and_routes_of_one_process():
    run_ranks(_generate_on_ranks, 2)
