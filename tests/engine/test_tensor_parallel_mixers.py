"""The tensor-parallel engine on GPT-OSS's sink attention and DeepSeek-V3's MLA, 2 gloo
processes (fp32 CPU). tiny-gpt-oss: each rank holds 2 of the 4 heads with their sinks and
biases, 1 of the 2 KV heads (the sliding layer's ring and the full layer's blocks hold that
head only), 2 of the 4 biased experts. tiny-deepseek-v3: each rank holds 2 of the 4 query
heads, their rows of q_b_proj and kv_b_proj, the whole latent projection (every rank keeps
the whole latent: kv_lora_rank + qk_rope_head_dim a position), half of the shared expert and
4 of the 8 routed experts. Both ranks draw exactly the tokens and routes one process with
the whole model draws (greedy, n samples sharing a prompt's blocks, preemption), log-probs
equal to fp32 rounding."""

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
    tensor_parallel_model,
)
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.parallel.blocks import rollout_shard_dim

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [12], [100, 3, 8, 19, 23, 60, 61]]
SAMPLED = SamplingParams(n=2, temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
LONG = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=5, ignore_eos=True)


def test_sinks_and_mla_up_projections_split_by_heads_the_latent_projection_whole():
    layer = "model.layers.0.self_attn."
    for name in ("sinks", "q_b_proj.weight", "kv_b_proj.weight", "q_proj.bias"):
        assert rollout_shard_dim(layer + name) == 0, name
    for name in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "q_a_proj.weight",
                 "q_a_layernorm.weight", "o_proj.bias"):  # fmt: skip
        assert rollout_shard_dim(layer + name) is None, name
    experts = "model.layers.1.mlp.experts."
    assert rollout_shard_dim(experts + "down_proj_bias") == 0
    assert rollout_shard_dim(experts + "down_proj_bias", split_experts=False) is None
    shared = "model.layers.1.mlp.shared_experts."
    assert rollout_shard_dim(shared + "up_proj.weight") == 0
    assert rollout_shard_dim(shared + "down_proj.weight") == 1
    # kv_b_proj [nh * (nope + v), r]: rank 1's rows are heads 2 and 3, whole
    full = torch.arange(4 * 3 * 2.0).view(12, 2)
    assert torch.equal(local_shard(layer + "kv_b_proj.weight", full, 1, 2), full[6:])


def test_local_shapes_of_sink_attention_and_mla():
    gpt_oss = local_architecture(preset_config("tiny-gpt-oss"), 2)
    assert (gpt_oss.num_attention_heads, gpt_oss.num_key_value_heads) == (2, 1)
    deepseek = local_architecture(preset_config("tiny-deepseek-v3"), 4)
    # MLA's num_key_value_heads (2) need not divide: 4 ranks split 4 heads, the latent whole
    assert (deepseek.num_attention_heads, deepseek.num_key_value_heads) == (1, 1)
    assert (deepseek.kv_lora_rank, deepseek.qk_rope_head_dim) == (32, 8)
    with pytest.raises(ValueError, match="moe_intermediate_size \\* n_shared_experts = 32"):
        local_architecture(preset_config("tiny-deepseek-v3").replace(num_attention_heads=6), 3,
                           split_experts=False)  # fmt: skip


def test_a_ranks_ring_of_a_window_past_max_seq_len_is_its_kv_heads_share_of_max_seq_len():
    """A rank's ring (its local shape's window_spec, as make_cache sizes it) of a window
    no 64-token sequence fills: 64 positions of its 1 KV head, what the plan prices a rank."""
    from hybridflow.engine.cache.window import window_spec
    from hybridflow.trainer.plan.memory_rollout import per_sequence_bytes

    whole = preset_config("tiny-gpt-oss").replace(attention_window=2**31 - 1)
    spec = window_spec(local_architecture(whole, 2), torch.float32, 64)
    assert (spec.window, spec.kv_heads) == (64, 1)
    assert spec.bytes_per_sequence == per_sequence_bytes(whole, 64, 4, tp=2) == 2 * 64 * 16 * 4


def _model(preset: str):
    """std-0.3 weights, sinks and biases (fp32), the same on every rank: peaked logits and
    routers far from ties."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config(preset), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def _state(model):
    """Parameters and saved buffers (DeepSeek's score correction), HF names."""
    saved = set(model.state_dict())
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    return [(name, tensor) for name, tensor in named if name in saved]


def _engine(model, budget=None, seq=64):
    options = EngineOptions(decode_backend="torch", cuda_graphs=False, kv_block_size=16,
                            cap_state_slots=False)  # fmt: skip
    return Engine(model, 8, seq, memory_budget=budget, options=options)


def _tensor_parallel_engine(whole, budget=None, seq=64):
    rank, size = dist.get_rank(), dist.get_world_size()
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, torch.float32, "cpu")
    engine = _engine(shard, budget, seq)
    engine.load_weights((name, local_shard(name, tensor, rank, size))
                        for name, tensor in _state(whole))  # fmt: skip
    return engine


def _compare(got, expected) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=1e-5)  # fmt: skip
        assert np.array_equal(a.routed_experts, b.routed_experts)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [c.token_ids for c in got])
    assert all(other == gathered[0] for other in gathered)


def _block_bytes(cache) -> int:
    """A block's bytes in a paged cache (K/V or latent, and the routing record), without the
    per-slot rings."""
    per_block = cache.routes[0].nbytes
    for blocks in (cache.keys, cache.values, cache.latent):
        if blocks is not None and blocks.numel():
            per_block += blocks[:, 0].nbytes
    return per_block


def _generate_on_ranks(rank: int, world: int, preset: str) -> None:
    whole_model = _model(preset)
    whole = _engine(whole_model)
    tp = _tensor_parallel_engine(whole_model)
    for params in (GREEDY, SAMPLED):
        _compare(tp.generate(PROMPTS, params), whole.generate(PROMPTS, params))
    cache, whole_cache = tp.cache, whole.cache
    if preset == "tiny-gpt-oss":  # this rank's KV head: half the whole model's rings and blocks
        assert cache.window.keys.shape[-2] * 2 == whole_cache.window.keys.shape[-2]
        assert cache.keys.shape[-2] * 2 == whole_cache.keys.shape[-2]
        rings = cache.window.nbytes()
    else:  # the whole latent on every rank
        assert cache.latent.shape == whole_cache.latent.shape and cache.keys.numel() == 0
        rings = 0
    # 14 blocks of 16 for 8 sequences growing to 2-4 blocks: the newest are preempted and
    # prefilled again on both ranks alike, and sample what an unpreempted run does
    expected = _engine(whole_model, seq=96).generate(PROMPTS, LONG)
    tight = _tensor_parallel_engine(whole_model, _block_bytes(cache) * 15 + rings, seq=96)
    _compare(tight.generate(PROMPTS, LONG), expected)
    assert tight.cache.num_blocks == 14 and tight.scheduler.paging.preemptions > 0


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-deepseek-v3"])
def test_two_ranks_draw_the_tokens_and_routes_of_one_process(preset):
    run_ranks(_generate_on_ranks, 2, preset)
