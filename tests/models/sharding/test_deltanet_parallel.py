"""Gated DeltaNet layers split by heads: a rank's heads mix as the whole layer's do (no
processes), and the tiny hybrid's packed forward, logits, loss and gradients under Ulysses
SP = 2 on 2 gloo ranks equal one process's (fp32), on a stream of several sequences, one of
which crosses the ranks' boundary; and on 4 ranks, Ulysses SP = 2 over the heads of tensor
parallelism TP = 2 (at the hybrid's fp32 floor: the split sums in another order, see
test_decoder_tensor_parallel.py)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_ranks import run_ranks
from model_helpers import randomized_model

from hybridflow.models.mixers.gated_deltanet import TokenLayout
from hybridflow.models.presets import PRESETS
from hybridflow.models.sharding.deltanet_parallel import (
    HeadShape,
    by_key_head,
    from_key_heads,
    head_channels,
    rank_weights,
)
from hybridflow.models.sharding.sequence_parallel import pad_positions, shard_stream, take_slice

# 19 tokens: 10 a rank on 2 ranks (one pad token); the second sequence (tokens 6..14)
# crosses the boundary at 10, within the conv's reach and the recurrent state's.
LENGTHS = [6, 9, 3, 1]


def _packed(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (sum(LENGTHS),), generator=g)
    targets = torch.randint(3, vocab, (sum(LENGTHS),), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return input_ids, targets, position_ids, cu_seqlens, max(LENGTHS)


def test_head_channels_take_each_key_head_with_its_value_group():
    # 2 key heads of 2 channels, 2 value heads each of 3 channels: q 0..3, k 4..7, v 8..19
    shape = HeadShape(key_heads=2, group=2, key_dim=2, value_dim=3)
    assert head_channels(shape, 1, 1).tolist() == [2, 3, 6, 7, *range(14, 20)]
    assert head_channels(shape, 0, 2).tolist() == list(range(20))


def test_key_head_packing_round_trips():
    shape = HeadShape(key_heads=2, group=2, key_dim=2, value_dim=3)
    mixed, a, b = torch.randn(5, 20), torch.randn(5, 4), torch.randn(5, 4)
    packed = by_key_head(mixed, a, b, shape)
    assert packed.shape == (5, 2, 2 + 2 + 6 + 2 + 2)
    for got, want in zip(from_key_heads(packed, shape), (mixed, a, b)):
        assert torch.equal(got, want)
    # one key head's slice is its channels and its value heads' gate inputs
    one = HeadShape(key_heads=1, group=2, key_dim=2, value_dim=3)
    mixed1, a1, _ = from_key_heads(packed[:, 1:], one)
    assert torch.equal(mixed1, mixed[:, head_channels(shape, 1, 1)])
    assert torch.equal(a1, a[:, 2:])


@pytest.mark.parametrize("size", [1, 2])
def test_each_rank_heads_mix_as_the_whole_layer_does(size):
    """What Ulysses computes on rank r (all tokens, its key heads and value groups, its
    slices of the conv, A_log and dt_bias) is the whole layer's output for those heads."""
    model = randomized_model(PRESETS["tiny-hybrid"])
    mixer = model.model.layers[0].linear_attn
    _, _, _, cu_seqlens, max_seqlen = _packed(128)
    layout = TokenLayout.packed(cu_seqlens, max_seqlen)
    x = torch.randn(int(cu_seqlens[-1]), model.config.hidden_size)
    mixed, a, b = mixer.in_proj_qkv(x), mixer.in_proj_a(x), mixer.in_proj_b(x)
    full, _ = mixer.mix(mixed, a, b, layout, mixer.head_weights())
    shape = HeadShape.of(mixer, mixed.shape[1], a.shape[1])
    count = shape.key_heads // size
    local = HeadShape(count, shape.group, shape.key_dim, shape.value_dim)
    packed = by_key_head(mixed, a, b, shape)
    for rank in range(size):
        mine = from_key_heads(packed[:, rank * count : (rank + 1) * count], local)
        part, _ = mixer.mix(*mine, layout, rank_weights(mixer.head_weights(), shape, rank, size))
        heads = slice(rank * count * shape.group, (rank + 1) * count * shape.group)
        torch.testing.assert_close(part, full[:, heads], rtol=1e-6, atol=1e-6)


def _close(actual, expected, where: str, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol,
                               msg=lambda m: f"{where}: {m}")  # fmt: skip


def _loss(model, hidden, targets, count: int):
    """Logits and the summed token cross-entropy over ``count`` tokens of the whole stream."""
    logits = model.lm_head(hidden)
    return logits, torch.nn.functional.cross_entropy(logits, targets, reduction="sum") / count


def _check_hybrid_ulysses(rank: int, world: int) -> None:
    group = dist.group.WORLD
    config = PRESETS["tiny-hybrid"]
    single, sharded = randomized_model(config).train(), randomized_model(config).train()
    input_ids, targets, position_ids, cu_seqlens, max_seqlen = _packed(config.vocab_size)
    count = input_ids.shape[0]
    hidden = single.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)
    logits, loss = _loss(single, hidden, targets, count)
    loss.backward()

    shard = shard_stream(cu_seqlens, max_seqlen, rank, world)
    local = sharded.forward_packed(take_slice(input_ids, shard),
                                   pad_positions(position_ids, shard), shard.cu_seqlens,
                                   shard.max_seqlen, sequence_group=group)  # fmt: skip
    real = min(shard.stop, count) - shard.start
    mine = slice(shard.start, shard.start + real)
    local_logits, local_loss = _loss(sharded, local[:real], targets[mine], count)
    _close(local_logits, logits[mine].detach(), "logits")
    local_loss.backward()  # each rank's share of the loss; the gradients sum over ranks
    summed = local_loss.detach().clone()
    dist.all_reduce(summed, group=group)
    _close(summed, loss.detach(), "loss")
    for (name, p_single), p_sharded in zip(single.named_parameters(), sharded.parameters()):
        grad = p_sharded.grad.clone()
        dist.all_reduce(grad, group=group)
        _close(grad, p_single.grad, name, rtol=1e-4)


@pytest.mark.slow
def test_two_rank_ulysses_hybrid_logits_loss_and_gradients_equal_one_process():
    run_ranks(_check_hybrid_ulysses, 2)


# 4 key heads of 8 value heads: TP = 2 leaves 2 a rank, SP = 2 one a rank; attention's 4
# heads / 2 KV heads: one KV head a TP rank, repeated for the 2 SP ranks
WIDER_HYBRID = dataclasses.replace(PRESETS["tiny-hybrid"], linear_num_key_heads=4,
                                   linear_num_value_heads=8, linear_key_head_dim=8,
                                   linear_value_head_dim=8)  # fmt: skip


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _check_ulysses_over_tensor_parallel(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hybridflow.models.sharding.tensor_parallel import parallelize_decoder

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("sp", "tp"))
    group = mesh["sp"].get_group()
    single = randomized_model(WIDER_HYBRID).train()
    split = randomized_model(WIDER_HYBRID).train()
    input_ids, targets, position_ids, cu_seqlens, max_seqlen = _packed(WIDER_HYBRID.vocab_size)
    count = input_ids.shape[0]
    hidden = single.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)
    logits = F.linear(hidden, single.lm_head.weight)
    (F.cross_entropy(logits, targets, reduction="sum") / count).backward()

    parallelize_decoder(split, mesh["tp"])
    shard = shard_stream(cu_seqlens, max_seqlen, mesh["sp"].get_local_rank(), 2)
    local = split.forward_packed(take_slice(input_ids, shard),
                                 pad_positions(position_ids, shard), shard.cu_seqlens,
                                 shard.max_seqlen, sequence_group=group)  # fmt: skip
    mine = slice(shard.start, min(shard.stop, count))
    local_logits = F.linear(local[: mine.stop - mine.start], _whole(split.lm_head.weight))
    _close(local_logits, logits[mine].detach(), "logits", atol=1e-4)
    (F.cross_entropy(local_logits, targets[mine], reduction="sum") / count).backward()
    params = dict(split.named_parameters())
    for name, param in single.named_parameters():
        grad = _whole(params[name].grad).clone()
        dist.all_reduce(grad, group=group)  # each SP rank's tokens' share
        _close(grad, param.grad, name, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_four_rank_ulysses_over_tensor_parallel_hybrid_equals_one_process():
    run_ranks(_check_ulysses_over_tensor_parallel, 4)
