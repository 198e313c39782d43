"""The tensor-parallel engine on 2 gloo processes (tiny preset, fp32 CPU): each rank holds
half of every layer, and both ranks draw exactly the tokens one process with the whole
model draws (greedy and sampled, n > 1, a paged and a slot cache, a kept conversation's
next turn), with log-probs equal to rounding."""

from __future__ import annotations

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
from hybridflow.parallel.blocks import shard_dim

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12]]


def test_shard_dims_follow_megatrons_split():
    assert shard_dim("model.layers.0.self_attn.q_proj.weight") == 0
    assert shard_dim("model.layers.0.self_attn.k_proj.bias") == 0
    assert shard_dim("model.layers.3.mlp.up_proj.weight") == 0
    assert shard_dim("model.layers.0.self_attn.o_proj.weight") == 1
    assert shard_dim("model.layers.0.self_attn.o_proj.bias") is None
    assert shard_dim("model.layers.0.mlp.down_proj.weight") == 1
    assert shard_dim("model.embed_tokens.weight") == 0 and shard_dim("lm_head.weight") == 0
    assert shard_dim("model.layers.0.input_layernorm.weight") is None
    assert shard_dim("model.layers.0.self_attn.q_norm.weight") is None
    full = torch.arange(24.0).view(4, 6)
    assert local_shard("model.layers.0.mlp.down_proj.weight", full, 1, 2).tolist() == [
        [3.0, 4.0, 5.0], [9.0, 10.0, 11.0], [15.0, 16.0, 17.0], [21.0, 22.0, 23.0]]  # fmt: skip


def test_local_shape_divides_heads_and_width_and_refuses_what_does_not_divide():
    local = local_architecture(preset_config("tiny"), 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert (local.intermediate_size, local.vocab_size, local.head_dim) == (96, 128, 16)
    with pytest.raises(ValueError, match="num_key_value_heads = 2"):
        local_architecture(preset_config("tiny"), 4)


def _model():
    """The tiny preset with peaked logits (std 0.3), the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.3, generator=generator)
        else:
            p.normal_(0, 0.1, generator=generator)
    return model


def _engines(block_size):
    group = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    whole = _model()
    shard = tensor_parallel_model(whole.config, group, torch.float32, "cpu")
    options = EngineOptions(kv_block_size=block_size)
    tp = Engine(shard, max_batch_size=8, max_seq_len=64, options=options)
    tp.load_weights((name, local_shard(name, tensor, rank, size))
                    for name, tensor in whole.named_parameters(remove_duplicate=False))  # fmt: skip
    return Engine(whole, max_batch_size=8, max_seq_len=64, options=options), tp


def _same_on_every_rank(tokens: list[list[int]]) -> None:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tokens)
    assert all(other == gathered[0] for other in gathered)


def _compare(whole, tp, params, **kwargs) -> None:
    expected = whole.generate(PROMPTS, params, **kwargs)
    got = tp.generate(PROMPTS, params, **kwargs)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert sum(len(c.token_ids) for c in got) > len(got)
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
    _same_on_every_rank([c.token_ids for c in got])


def _generate_on_ranks(rank: int, world: int) -> None:
    for block_size in (16, None):  # paged, slots
        whole, tp = _engines(block_size)
        assert tp.tensor_parallel == 2 and tp.decode_backend == "torch"
        # this rank's KV heads only: half of the whole model's cache per slot
        assert tp.num_slots == whole.num_slots
        assert tp.cache.keys.shape[-2] * 2 == whole.cache.keys.shape[-2]
        _compare(whole, tp, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
        _compare(whole, tp, SamplingParams(n=3, temperature=1.0, top_k=40, max_new_tokens=12,
                                           seed=7, ignore_eos=True))  # fmt: skip
        _compare(whole, tp, SamplingParams(n=2, temperature=0.9, max_new_tokens=8, seed=3),
                 sample_index=[0, 2, 4, 6])  # fmt: skip
    # a kept conversation's next turn: the new tokens extend the kept K/V (extend_forward)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=2, ignore_eos=True)
    first = [e.generate(PROMPTS[:2], params, keep=True) for e in (whole, tp)]
    turns = [[PROMPTS[i] + c.token_ids + [30, 31] for i, c in enumerate(f)] for f in first]
    assert turns[0] == turns[1]
    handles = [[c.kv_handle for c in f] for f in first]
    after = [e.generate(turns[0], params, reuse=h) for e, h in zip((whole, tp), handles)]
    assert [c.token_ids for c in after[1]] == [c.token_ids for c in after[0]]


@pytest.mark.slow
def test_two_ranks_draw_the_tokens_of_one_process():
    """On the torch backend (the fused layers' run: test_tensor_parallel_fused.py)."""
    run_ranks(_generate_on_ranks, 2)
