"""Sampler (torch reference): hash arithmetic, filters, the hierarchical draw's distribution
(one split and several), its rounding fallback, and the pre-filter log-prob."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.engine import sampling
from hybridflow.engine.sampling import (
    SamplingParams,
    hierarchical_draw,
    mix32,
    request_seeds,
    sample_reference,
    split_seed,
)


def _mix32_python(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_matches_python_uint32_arithmetic():
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 123456789, 3735928559]
    got = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_mix32_python(v) for v in values]


def test_params_validation_names_every_problem():
    with pytest.raises(ValueError, match="top_p=0.*min_p=1.5"):
        SamplingParams(top_p=0.0, min_p=1.5)


def _draw(logits_row: torch.Tensor, params: SamplingParams, count: int, split_size: int):
    """`count` independent samples of one distribution: one row per sample, each its own seed."""
    logits = logits_row.expand(count, -1)
    lo, hi = split_seed(request_seeds(7, count, 1))
    steps = torch.zeros(count, dtype=torch.int64)
    return sample_reference(logits, params, lo, hi, steps, split_size=split_size)


def _expected(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution written out literally (sort, walk, renormalise)."""
    probs = torch.softmax(logits_row.double() / params.temperature, -1)
    order = probs.argsort(descending=True).tolist()
    keep = order[: params.top_k] if params.top_k > 0 else order
    if params.top_p < 1:
        mass = sum(probs[i].item() for i in keep)
        kept, acc = [], 0.0
        for i in keep:
            kept.append(i)
            acc += probs[i].item() / mass
            if acc >= params.top_p:
                break
        keep = kept
    if params.min_p > 0:
        keep = [i for i in keep if probs[i] >= params.min_p * probs.max()]
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.15),
    ],
    ids=["T1", "T0.6", "topk3", "topp0.7", "topk5+topp0.8", "minp0.15"],
)
@pytest.mark.parametrize("split_size", [4096, 3], ids=["one-split", "3-splits"])
def test_sampled_frequencies_match_distribution(params, split_size):
    """Total-variation distance between empirical and target distribution over 8 tokens with
    N = 40000 draws: E[TV] <= 0.5 * sqrt(V / N) = 0.007; we require TV < 0.02 (a wrong filter
    or temperature moves TV by > 0.05 on these logits). Filtered-out tokens must never appear.
    split_size 3 cuts the 8 tokens into splits of 3, 3, 2 (the most likely tokens spread over
    two splits, the last one short): a wrong split choice or in-split walk moves TV too."""
    logits_row = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])
    tokens, _ = _draw(logits_row, params, 40000, split_size)
    empirical = torch.bincount(tokens, minlength=8).double() / tokens.numel()
    expected = _expected(logits_row, params)
    tv = 0.5 * (empirical - expected).abs().sum().item()
    assert tv < 0.02, f"TV={tv:.4f} empirical={empirical} expected={expected}"
    assert empirical[expected == 0].sum() == 0


def test_logprob_is_temperature_scaled_and_unfiltered():
    logits = torch.randn(64, 50) * 2
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05)
    lo, hi = split_seed(request_seeds(3, 64, 1))
    tokens, logprobs = sample_reference(logits, params, lo, hi, torch.arange(64))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-6)


def test_greedy_is_argmax_with_unit_temperature_logprob():
    logits = torch.randn(10, 30)
    lo, hi = split_seed(request_seeds(0, 10, 1))
    tokens, logprobs = sample_reference(
        logits, SamplingParams(temperature=0), lo, hi, torch.zeros(10, dtype=torch.int64)
    )
    assert tokens.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize("split_size", [4096, 64])
def test_noise_depends_on_seed_and_step_only(split_size):
    logits = torch.zeros(4, 1000)  # uniform: the token is decided by the noise alone
    lo, hi = split_seed(request_seeds(11, 4, 1))
    steps = torch.tensor([0, 1, 2, 3])
    params = SamplingParams()

    def draw(*args):
        return sample_reference(*args, split_size=split_size)

    tokens, _ = draw(logits, params, lo, hi, steps)
    # row 2 alone, in another batch position, draws the same token; so does a rerun
    again, _ = draw(logits[:1], params, lo[2:3], hi[2:3], steps[2:3])
    assert again.item() == tokens[2].item()
    assert draw(logits, params, lo, hi, steps)[0].tolist() == tokens.tolist()
    # different steps of one request draw different tokens (1000 uniform choices)
    same_seed, logprobs = draw(logits, params, lo[:1].expand(4), hi[:1].expand(4), steps)
    assert len(set(same_seed.tolist())) == 4
    assert math.isfinite(logprobs.sum().item())


def test_uniform_draws_cover_every_split():
    """Uniform logits over 1000 tokens in 16 splits (the last one 40 tokens): every split is
    chosen, in proportion to its size (the short last split about 40/1000 of the time)."""
    count = 20000
    logits = torch.zeros(count, 1000)
    lo, hi = split_seed(request_seeds(2, count, 1))
    tokens, _ = sample_reference(logits, SamplingParams(), lo, hi, torch.zeros(count).long(), 64)
    per_split = torch.bincount(tokens // 64, minlength=16).double() / count
    expected = torch.full((16,), 64 / 1000, dtype=torch.float64)
    expected[-1] = 40 / 1000
    assert (per_split - expected).abs().max() < 0.01  # sd per split ~0.0017
    assert tokens.max() < 1000


@pytest.mark.parametrize("u2", [1.0, 1.5])
def test_rounding_fallback_returns_the_last_allowed_token_of_the_split(monkeypatch, u2):
    """u2 -> 1 puts the inverse-CDF target at the split's total mass, which the running sum
    may miss by rounding (u2 = 1.5 forces the miss): the draw must still land on an allowed
    token of the chosen split (its last one with mass), never on a filtered or padding one."""
    monkeypatch.setattr(sampling, "scan_uniform", lambda keys: torch.full(keys.shape, u2))
    z = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, -5.0, 0.9, 1.0, -5.0]])  # splits of 4
    keys = torch.arange(200, dtype=torch.int64)[:, None].expand(-1, 1).flatten()
    tokens = hierarchical_draw(z.expand(200, -1), torch.full((200,), -1.0), keys, split_size=4)
    # the last allowed token of splits [0..3], [4..7], [8..10] is 3, 6 (7 is filtered), 9
    assert set(tokens.tolist()) == {3, 6, 9}


def test_seed_values_as_ints_equal_the_tensor_derivation():
    """A server's request derives its seeds on Python ints (no tensor ops); they must be the
    tensor path's bit for bit, for any base seed (negative, beyond 32 bits) and sample."""
    from hybridflow.engine.sampling import prompt_seed_values, prompt_seeds, request_seeds

    bases = [0, 1, 7, 2**31, 2**32 + 5, 2**62 - 1, -3, 123456789123]
    assert prompt_seed_values(bases, 3) == prompt_seeds(bases, 3).tolist()
    assert prompt_seed_values([42], 4) == request_seeds(42, 1, 4).tolist()


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5, 1e-320, 1e308])
def test_a_temperature_float32_cannot_divide_by_is_refused(temperature):
    # 1e308 overflows float32 (the request never finished); 1e-320 and NaN turn logits NaN
    with pytest.raises(ValueError, match="temperature="):
        SamplingParams(temperature=temperature)
