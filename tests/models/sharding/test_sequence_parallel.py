"""Ulysses sequence parallelism: the packed forward and its gradients on 2 gloo ranks equal one
process; the head and stream arithmetic, checked without processes."""

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from model_helpers import randomized_model, small_config

from hybridflow.models.attention import sdpa_loop_attention
from hybridflow.models.sharding.sequence_parallel import (
    gather_outputs,
    kv_repeats,
    output_counts,
    output_range,
    pad_positions,
    shard_stream,
    take_slice,
)

LENGTHS = [5, 8, 3, 1]  # 17 tokens: on 2 ranks the stream gets one pad token


def _packed(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (sum(LENGTHS),), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return input_ids, position_ids, cu_seqlens, max(LENGTHS)


def test_shard_stream_pads_to_a_multiple_and_isolates_the_pad():
    _, position_ids, cu_seqlens, max_seqlen = _packed(97)
    shards = [shard_stream(cu_seqlens, max_seqlen, rank, 2) for rank in range(2)]
    # 17 tokens -> 9 per rank; the pad token (index 17) is a sequence of its own.
    assert [(s.start, s.stop, s.pad) for s in shards] == [(0, 9, 1), (9, 18, 1)]
    assert shards[0].cu_seqlens.tolist() == [0, 5, 13, 16, 17, 18]
    assert take_slice(torch.arange(17), shards[1], fill=-1).tolist() == [*range(9, 17), -1]
    assert pad_positions(position_ids, shards[1]).tolist() == [4, 5, 6, 7, 0, 1, 2, 0, 0]
    # On 3 ranks: 6 per rank, one pad; the last rank's pad position counts from 0.
    last = shard_stream(cu_seqlens, max_seqlen, 2, 3)
    assert (last.start, last.stop, last.pad) == (12, 18, 1)
    hidden_index = torch.tensor([1, 4, 8, 9, 15, 16])
    assert output_range(hidden_index, shards[0]) == (0, 3)
    assert output_counts(hidden_index, shards) == [3, 3]


def test_shard_stream_gives_each_rank_a_multiple_of_the_token_multiple():
    """FP8 training's 16: 17 tokens on 2 ranks -> 16 per rank, the 15 pad tokens one
    sequence of their own at the end; 17 on 3 ranks -> 16 per rank, 31 pads."""
    _, position_ids, cu_seqlens, max_seqlen = _packed(97)
    shards = [shard_stream(cu_seqlens, max_seqlen, rank, 2, multiple=16) for rank in range(2)]
    assert [(s.start, s.stop, s.pad) for s in shards] == [(0, 16, 15), (16, 32, 15)]
    assert shards[0].cu_seqlens.tolist() == [0, 5, 13, 16, 17, 32]
    assert shards[0].max_seqlen == 15
    assert pad_positions(position_ids, shards[1]).tolist() == [0, *range(15)]
    assert take_slice(torch.arange(17), shards[1], fill=-1).tolist() == [16, *[-1] * 15]
    last = shard_stream(cu_seqlens, max_seqlen, 2, 3, multiple=16)
    assert (last.start, last.stop, last.pad) == (32, 48, 31)
    assert pad_positions(position_ids, last).tolist() == list(range(15, 31))


@pytest.mark.parametrize(
    "heads, kv_heads, sp, repeats",
    [(4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 2), (8, 4, 8, 2), (12, 6, 4, 2), (4, 4, 4, 1)],
)
def test_kv_repeats(heads, kv_heads, sp, repeats):
    assert kv_repeats(heads, kv_heads, sp) == repeats


@pytest.mark.parametrize("heads, kv_heads, sp", [(4, 2, 8), (6, 2, 4), (8, 1, 3)])
def test_kv_repeats_refuses_what_cannot_split(heads, kv_heads, sp):
    with pytest.raises(ValueError, match="sequence-parallel ranks"):
        kv_repeats(heads, kv_heads, sp)


@pytest.mark.parametrize("heads, kv_heads, sp", [(4, 1, 2), (8, 2, 4), (12, 6, 4), (4, 2, 2)])
def test_each_rank_heads_read_the_right_kv_heads(heads, kv_heads, sp):
    """Rank r's query heads with its block of the repeated KV heads give exactly heads
    r*nh/sp.. of the full grouped-query attention (what Ulysses computes on rank r)."""
    q = torch.randn(11, heads, 8)
    k, v = torch.randn(11, kv_heads, 8), torch.randn(11, kv_heads, 8)
    full = sdpa_loop_attention(q, k, v, lengths=[4, 7])
    repeats = kv_repeats(heads, kv_heads, sp)
    k_rep, v_rep = (t.repeat_interleave(repeats, dim=1) for t in (k, v))
    q_block, kv_block = heads // sp, kv_heads * repeats // sp
    for rank in range(sp):
        qs = slice(rank * q_block, (rank + 1) * q_block)
        kvs = slice(rank * kv_block, (rank + 1) * kv_block)
        part = sdpa_loop_attention(q[:, qs], k_rep[:, kvs], v_rep[:, kvs], lengths=[4, 7])
        torch.testing.assert_close(part, full[:, qs])


CONFIGS = {
    "qwen3 gqa": small_config("qwen3"),  # qk-norm, 4 heads / 2 KV heads: SP=2 splits both
    "qwen2 one kv head": small_config("qwen2", num_key_value_heads=1),  # KV head repeated
}


def _close(actual: torch.Tensor, expected: torch.Tensor, where: str, rtol: float) -> None:
    torch.testing.assert_close(
        actual, expected, atol=1e-5, rtol=rtol, msg=lambda m: f"{where}: {m}"
    )


def _check_sequence_parallel_forward_backward(rank: int, world: int) -> None:
    group = dist.group.WORLD
    for name, config in CONFIGS.items():
        single = randomized_model(config).train()
        sharded = randomized_model(config).train()
        input_ids, position_ids, cu_seqlens, max_seqlen = _packed(config.vocab_size)
        num_tokens = input_ids.shape[0]
        weights = torch.randn(
            num_tokens, config.hidden_size, generator=torch.Generator().manual_seed(1)
        )
        full = single.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)
        (full * weights).sum().backward()

        shard = shard_stream(cu_seqlens, max_seqlen, rank, world)
        local = sharded.forward_packed(
            take_slice(input_ids, shard),
            pad_positions(position_ids, shard),
            shard.cu_seqlens,
            shard.max_seqlen,
            sequence_group=group,
        )
        real = min(shard.stop, num_tokens) - shard.start
        _close(local[:real], full[shard.start : shard.start + real].detach(), name, rtol=1e-5)
        # Each rank back-propagates its tokens' share; the shares sum to the whole gradient.
        (local[:real] * weights[shard.start : shard.start + real]).sum().backward()
        for (param_name, p_single), p_sharded in zip(single.named_parameters(),
                                                     sharded.parameters()):  # fmt: skip
            if p_single.grad is None:  # lm_head: the test's loss reads hidden states
                assert p_sharded.grad is None
                continue
            grad = p_sharded.grad.clone()
            dist.all_reduce(grad, group=group)
            _close(grad, p_single.grad, f"{name}: {param_name}", rtol=1e-4)


def _check_gather_outputs(rank: int, world: int) -> None:
    """Per-rank runs of different lengths gather in rank order; a loss every rank computes
    from the whole gives each rank the gradient of its own run."""
    counts = [3, 1]
    values = torch.arange(4.0) + 1
    mine = values[sum(counts[:rank]) : sum(counts[: rank + 1])].clone().requires_grad_()
    gathered = gather_outputs(mine, counts, dist.group.WORLD)
    assert gathered.tolist() == values.tolist()
    (gathered.square().sum() * 0.5).backward()
    assert mine.grad.tolist() == mine.detach().tolist()  # d/dx x²/2 = x, own run only


def _ranks(rank: int, world: int) -> None:
    _check_gather_outputs(rank, world)
    _check_sequence_parallel_forward_backward(rank, world)


@pytest.mark.slow
def test_two_rank_ulysses_forward_and_gradients_equal_one_process():
    run_ranks(_ranks, 2)


def test_ulysses_attention_equals_attention_in_one_process_of_one_rank():
    """SP of one rank is the ordinary forward (the all-to-alls are identities)."""
    import os

    from gloo_ranks import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    model = randomized_model(small_config("llama"))
    input_ids, position_ids, cu_seqlens, max_seqlen = _packed(97)
    group = None
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
        group = dist.group.WORLD
    try:
        with torch.no_grad():
            want = model.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)
            got = model.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen,
                                       sequence_group=dist.group.WORLD)  # fmt: skip
        torch.testing.assert_close(got, want)
    finally:
        if group is not None:
            dist.destroy_process_group()


def test_ulysses_refuses_attention_sinks_over_a_window_and_runs_recurrent_layers():
    """GPT-OSS's sink layers run a window of each sequence outside the Ulysses exchange:
    refused, naming the key; Gated DeltaNet layers run (models/sharding/deltanet_parallel.py)."""
    import os

    from gloo_ranks import free_port

    from hybridflow.models import build_model
    from hybridflow.models.presets import PRESETS

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    input_ids, position_ids, cu_seqlens, max_seqlen = _packed(97)
    group = None
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
        group = dist.group.WORLD
    try:
        with torch.no_grad():
            sinks = build_model(PRESETS["tiny-gpt-oss"])
            with pytest.raises(
                ValueError, match="attention sinks .* actor.sequence_parallel_size=1"
            ):
                sinks.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen,
                                     sequence_group=dist.group.WORLD)  # fmt: skip
            hybrid = build_model(PRESETS["tiny-hybrid"])
            want = hybrid.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)
            got = hybrid.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen,
                                        sequence_group=dist.group.WORLD)  # fmt: skip
        torch.testing.assert_close(got, want)
    finally:
        if group is not None:
            dist.destroy_process_group()
