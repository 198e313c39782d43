"""The vocab-parallel log-prob and entropy on 2 gloo ranks equal the full computation, values
and gradients, without any rank holding the whole vocabulary."""

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.models.heads.logprobs import naive_logprobs
from hybridflow.models.sharding.vocab_parallel import vocab_parallel_logprobs

VOCAB, HIDDEN, TOKENS = 97, 16, 13  # 97 rows split 49 / 48: uneven shards work too


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    targets[:2] = torch.tensor([48, 49])  # the last row of rank 0 and the first of rank 1
    grads = torch.randn(2, TOKENS, generator=g, dtype=torch.float64)
    return hidden, weight, targets, grads


def _check(rank: int, world: int) -> None:
    hidden, weight, targets, (g_logprob, g_entropy) = _inputs()
    rows = -(-VOCAB // world)
    vocab_start = rank * rows
    for temperature in (1.0, 0.7):
        h_full = hidden.clone().requires_grad_()
        w_full = weight.clone().requires_grad_()
        want_logprob, want_entropy = naive_logprobs(h_full, w_full, targets, temperature)
        ((want_logprob * g_logprob).sum() + (want_entropy * g_entropy).sum()).backward()

        h = hidden.clone().requires_grad_()
        shard = weight[vocab_start : vocab_start + rows].clone().requires_grad_()
        logprob, entropy = vocab_parallel_logprobs(
            h, shard, targets, dist.group.WORLD, vocab_start=vocab_start,
            temperature=temperature, with_entropy=True, chunk_size=5,
        )  # fmt: skip
        ((logprob * g_logprob).sum() + (entropy * g_entropy).sum()).backward()
        torch.testing.assert_close(logprob, want_logprob)
        torch.testing.assert_close(entropy, want_entropy)
        torch.testing.assert_close(h.grad, h_full.grad)
        torch.testing.assert_close(shard.grad, w_full.grad[vocab_start : vocab_start + rows])
        # log-probs alone (no entropy term in the backward)
        h.grad = None
        logprob, none = vocab_parallel_logprobs(h, shard, targets, dist.group.WORLD,
                                                vocab_start=vocab_start, temperature=temperature)  # fmt: skip
        assert none is None
        (logprob * g_logprob).sum().backward()
        h_alone = hidden.clone().requires_grad_()
        (naive_logprobs(h_alone, weight, targets, temperature)[0] * g_logprob).sum().backward()
        torch.testing.assert_close(h.grad, h_alone.grad)


@pytest.mark.slow
def test_two_rank_vocab_parallel_logprobs_equal_the_full_vocabulary():
    run_ranks(_check, 2)
