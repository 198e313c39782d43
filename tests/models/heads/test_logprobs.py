"""Chunked log-probs/entropy equal the naive full-logits computation, values and gradients."""

import pytest
import torch

from hybridflow.models.heads.logprobs import logprobs_from_hidden, naive_logprobs


def _inputs(n=37, h=16, v=53, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [5, 4096])
def test_values_and_gradients_match_naive(temperature, chunk_size):
    hidden, weight, targets = _inputs()
    g = torch.Generator().manual_seed(1)
    grad_lp = torch.randn(len(targets), generator=g, dtype=torch.float64)
    grad_ent = torch.randn(len(targets), generator=g, dtype=torch.float64)

    logprobs, entropy = logprobs_from_hidden(
        hidden, weight, targets, temperature=temperature, with_entropy=True, chunk_size=chunk_size
    )
    assert logprobs.dtype == entropy.dtype == torch.float32
    ((logprobs.double() * grad_lp).sum() + (entropy.double() * grad_ent).sum()).backward()
    ours = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    ref_lp, ref_ent = naive_logprobs(hidden, weight, targets, temperature)
    ((ref_lp * grad_lp).sum() + (ref_ent * grad_ent).sum()).backward()
    torch.testing.assert_close(logprobs, ref_lp.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_ent.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1], weight.grad, atol=1e-5, rtol=1e-5)


def test_logprob_only_gradients_and_no_entropy():
    hidden, weight, targets = _inputs(seed=3)
    logprobs, entropy = logprobs_from_hidden(hidden, weight, targets, chunk_size=8)
    assert entropy is None
    logprobs.sum().backward()
    ours = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    naive_logprobs(hidden, weight, targets)[0].sum().backward()
    torch.testing.assert_close(ours[0], hidden.grad)
    torch.testing.assert_close(ours[1], weight.grad)


def test_entropy_only_gradient():
    hidden, weight, targets = _inputs(seed=4)
    _, entropy = logprobs_from_hidden(hidden, weight, targets, with_entropy=True, chunk_size=6)
    entropy.sum().backward()
    ours = hidden.grad.clone()
    hidden.grad = weight.grad = None
    naive_logprobs(hidden, weight, targets)[1].sum().backward()
    torch.testing.assert_close(ours, hidden.grad)


def test_hand_computed_uniform_logits():
    """Zero hidden -> uniform distribution: logprob = -log V, entropy = log V."""
    vocab = 10
    hidden = torch.zeros(3, 4)
    weight = torch.randn(vocab, 4)
    logprobs, entropy = logprobs_from_hidden(
        hidden, weight, torch.tensor([0, 5, 9]), with_entropy=True
    )
    expected = torch.full((3,), torch.log(torch.tensor(float(vocab))).item())
    torch.testing.assert_close(logprobs, -expected)
    torch.testing.assert_close(entropy, expected)
