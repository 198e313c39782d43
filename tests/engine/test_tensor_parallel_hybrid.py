"""The tensor-parallel engine on Qwen3.5's layers, 2 gloo processes (fp32 CPU). tiny-hybrid:
each rank holds 2 of the 4 gated-attention heads with their output gates and 1 of the 2 KV
heads; in its 3 Gated DeltaNet layers 1 of the 2 key heads with its 2 value heads (their rows
of in_proj_qkv and the conv taps, of in_proj_z/a/b, their A_log and dt_bias), so its
recurrent cache holds half the conv channels and SSM state [S, 2, Dk, Dv]. The Qwen3.5-MoE
variant also splits the experts (2 of 4 a rank) and the gated shared expert's width. Both
ranks draw exactly the tokens one process with the whole model draws (greedy, n samples
copying a prompt's state, preemption), log-probs equal to fp32 rounding; on the triton
backend too (its Triton recurrent step over the rank's heads; TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from test_tensor_parallel_mixers import GREEDY, LONG, PROMPTS, SAMPLED, _compare, _engine

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.tensor_parallel import local_architecture, local_shard, tensor_parallel_model
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.models.sharding.deltanet_parallel import HeadShape, head_channels
from hybridflow.parallel.blocks import deltanet_sections, rollout_pieces, rollout_shard_dim


def _config(moe: bool):
    config = preset_config("tiny-hybrid")
    if moe:  # Qwen3.5-MoE's layers: routed experts and a gated shared expert
        config = config.replace(model_type="qwen3_5_moe_text", num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=True)  # fmt: skip
    return config


def test_deltanet_rows_split_by_key_heads_with_their_value_heads():
    config = preset_config("tiny-hybrid")  # Hk 2, Hv 4, Dk = Dv = 16: [q 32; k 32; v 64]
    layer = "model.layers.0.linear_attn."
    for name in ("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias",
                 "in_proj_qkv.weight", "conv1d.weight"):  # fmt: skip
        assert rollout_shard_dim(layer + name) == 0, name
    assert rollout_shard_dim(layer + "out_proj.weight") == 1
    assert rollout_shard_dim(layer + "norm.weight") is None
    assert rollout_shard_dim("model.layers.3.self_attn.q_norm.weight") is None
    sections = deltanet_sections(config)
    assert sections == (32, 32, 64)
    # rank 1: key head 1's q rows 16..31 and k rows 48..63, value heads 2, 3: rows 96..127
    assert rollout_pieces(layer + "in_proj_qkv.weight", (128, 64), 1, 2, sections=sections) == (
        ((16, 32), (0, 64)), ((48, 64), (0, 64)), ((96, 128), (0, 64)))  # fmt: skip
    full = torch.arange(128 * 4.0).view(128, 1, 4)  # conv taps [C, 1, K]
    shape = HeadShape(key_heads=2, group=2, key_dim=16, value_dim=16)
    for rank in range(2):  # the channels training's tensor parallelism gives the same rank
        got = local_shard(layer + "conv1d.weight", full, rank, 2, sections=sections)
        assert torch.equal(got, full[head_channels(shape, rank, 1)])
    with pytest.raises(ValueError, match="sections"):
        local_shard(layer + "conv1d.weight", full, 0, 2)


def test_local_shape_of_the_hybrid_layers():
    local = local_architecture(_config(moe=True), 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 2)
    assert local.shared_expert_intermediate_size == 24 and local.num_experts == 4
    with pytest.raises(ValueError, match="linear_num_key_heads = 2"):
        local_architecture(preset_config("tiny-hybrid").replace(num_attention_heads=3 * 4,
                                                                num_key_value_heads=3), 3)  # fmt: skip


def _model(config):
    """std-0.1 weights (fp32), the same on every rank: routers far from ties, logits small
    enough that fp32 rounding (the all-reduce sums in another order) stays under 1e-5."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(config, seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _tensor_parallel_engine(whole, budget=None, seq=64):
    rank, size = dist.get_rank(), dist.get_world_size()
    sections = deltanet_sections(whole.config)
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, torch.float32, "cpu")
    engine = _engine(shard, budget, seq)
    engine.load_weights((name, local_shard(name, tensor, rank, size, sections=sections))
                        for name, tensor in whole.named_parameters(remove_duplicate=False))  # fmt: skip
    return engine


def _generate_on_ranks(rank: int, world: int, moe: bool) -> None:
    whole_model = _model(_config(moe))
    whole = _engine(whole_model, seq=96)
    tp = _tensor_parallel_engine(whole_model, seq=96)
    for params in (GREEDY, SAMPLED):
        _compare(tp.generate(PROMPTS, params), whole.generate(PROMPTS, params))
    states, whole_states = tp.cache.states, whole.cache.states
    assert states.conv.shape[2] * 2 == whole_states.conv.shape[2]  # the rank's channels
    assert states.ssm.shape[2] * 2 == whole_states.ssm.shape[2]  # [.., Hv / 2, Dk, Dv]
    assert tp.cache.keys.shape[-2] * 2 == whole.cache.keys.shape[-2]  # 1 of 2 KV heads
    # 14 blocks of 16 (and the slots' states) for 8 sequences growing to 2-4 blocks: the
    # newest are preempted and prefilled again on both ranks alike, their states rebuilt
    block = tp.cache.keys[:, 0].nbytes + tp.cache.values[:, 0].nbytes
    if tp.cache.routes is not None:
        block += tp.cache.routes[0].nbytes
    budget = block * 15 + states.nbytes()  # 8 slots' states and the scratch one's
    tight = _tensor_parallel_engine(whole_model, budget, seq=96)
    _compare(tight.generate(PROMPTS, LONG), whole.generate(PROMPTS, LONG))
    assert tight.cache.num_blocks == 14 and tight.scheduler.paging.preemptions > 0


@pytest.mark.parametrize("moe", [False, True], ids=["tiny-hybrid", "tiny-hybrid-moe"])
def test_two_ranks_draw_the_tokens_of_one_process(moe):
    run_ranks(_generate_on_ranks, 2, moe)


TRITON_STEP = SamplingParams(n=2, temperature=0.9, max_new_tokens=4, seed=3, ignore_eos=True)


def _triton_steps_on_ranks(rank: int, world: int) -> None:
    """decode_backend="triton": the model's eager passes with the Triton recurrent step and
    attention kernel (kernels/delta_step.py) over the rank's heads."""
    whole_model = _model(_config(moe=False))
    options = EngineOptions(decode_backend="triton", kv_block_size=16, cap_state_slots=False)
    whole = Engine(whole_model, 4, 32, options=options)
    shard = tensor_parallel_model(whole_model.config, dist.group.WORLD, torch.float32, "cpu")
    tp = Engine(shard, 4, 32, options=options)
    sections = deltanet_sections(whole_model.config)
    tp.load_weights((name, local_shard(name, tensor, rank, world, sections=sections))
                    for name, tensor in whole_model.named_parameters(remove_duplicate=False))  # fmt: skip
    assert tp.recurrent_step == whole.recurrent_step == "triton"
    _compare(tp.generate(PROMPTS[:2], TRITON_STEP), whole.generate(PROMPTS[:2], TRITON_STEP))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on CPU need TRITON_INTERPRET=1")  # fmt: skip
@pytest.mark.slow
def test_two_ranks_on_the_triton_recurrent_step_draw_the_tokens_of_one_process():
    pytest.importorskip("triton")
    run_ranks(_triton_steps_on_ranks, 2)
