"""Speculative sampling keeps the distribution (speculative/acceptance.py): on a 6-token
vocabulary and a toy first-order target (next-token logits a table of the previous token),
the first two tokens emitted by verify passes of two drafts are counted over many seeds and
tested against the exact joint distribution with a chi-square test; the same test rejects a
greedy acceptance and a rejection that resamples from p instead of the residual."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.engine.sampling import SamplingParams, allowed_probs_reference, sample_reference
from hybridflow.engine.speculative.acceptance import (
    accepted_lengths,
    emitted_lengths,
    speculative_accept,
)

VOCAB = 6
TRIALS = 30000
TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 1.5  # [prev, V]
START = 2
MODES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05),
]


def _chi2_critical(dof: int, z: float = 4.0) -> float:
    """Wilson-Hilferty quantile of chi-square(dof) at the normal quantile z (4.0: p ~ 3e-5)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi2(first: torch.Tensor, second: torch.Tensor, params: SamplingParams) -> tuple:
    """(statistic, critical value) of the emitted pairs' counts against the exact joint."""
    probs = allowed_probs_reference(TABLE, params)  # [prev, V]
    expected = (probs[START][:, None] * probs).flatten() * len(first)  # [V * V]
    observed = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).double()
    assert observed[expected == 0].sum() == 0, "a token outside the allowed set was emitted"
    cells = expected > 0
    stat = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    return float(stat), _chi2_critical(int(cells.sum()) - 1)


def _seeds(count: int):
    seeds = torch.arange(count, dtype=torch.int64) * 7919 + 12345
    return seeds & 0xFFFFFFFF, seeds >> 32


def _sample(prev: torch.Tensor, step: int, params, seed_lo, seed_hi) -> torch.Tensor:
    steps = torch.full_like(prev, step)
    return sample_reference(TABLE[prev], params, seed_lo, seed_hi, steps)[0]


def _drafts() -> torch.Tensor:
    """Any deterministic drafts (independent of the sampling noise): two per trial, cycling
    over every pair of tokens so some are likely and some are not."""
    trial = torch.arange(TRIALS)
    return torch.stack([trial % VOCAB, (trial // VOCAB) % VOCAB], 1)  # [N, 2]


def _verified_pairs(params, accept) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first two tokens each trial emits: one verify pass of its two drafts (inputs the
    last token and the drafts, sampled at steps 0, 1, 2), then, when only one token came
    out, a plain step after it. -> (first, second, accepted)."""
    seed_lo, seed_hi = _seeds(TRIALS)
    drafts = _drafts()
    inputs = torch.cat([torch.full((TRIALS, 1), START), drafts], 1)  # [N, 3]
    sampled = torch.stack([_sample(inputs[:, i], i, params, seed_lo, seed_hi)
                           for i in range(3)], 1)  # fmt: skip  # [N, 3]
    accepted = accept(sampled, drafts, inputs)
    first = sampled[:, 0]
    plain_second = _sample(first, 1, params, seed_lo, seed_hi)
    second = torch.where(accepted >= 1, sampled[:, 1], plain_second)
    return first, second, accepted


def _coupled(sampled, drafts, inputs):
    return accepted_lengths(sampled, drafts, torch.full((TRIALS,), 2))


def _greedy(sampled, drafts, inputs):
    """Wrong: keep a draft when it is the target's most likely token."""
    best = TABLE[inputs[:, :2]].argmax(-1)  # [N, 2]
    return (drafts == best).to(torch.int64).cumprod(1).sum(1)


@pytest.mark.parametrize("params", MODES, ids=lambda p: str(p.mode_key()))
def test_verified_tokens_follow_the_target_distribution(params):
    first, second, accepted = _verified_pairs(params, _coupled)
    stat, critical = _chi2(first, second, params)
    assert stat < critical, (stat, critical)
    assert 0 < int((accepted > 0).sum()) < TRIALS  # both paths taken
    # and, seed for seed, they are the tokens plain sampling draws
    seed_lo, seed_hi = _seeds(TRIALS)
    plain_first = _sample(torch.full((TRIALS,), START), 0, params, seed_lo, seed_hi)
    assert torch.equal(first, plain_first)
    assert torch.equal(second, _sample(plain_first, 1, params, seed_lo, seed_hi))


def test_greedy_acceptance_fails_the_test():
    first, second, _ = _verified_pairs(MODES[0], _greedy)
    stat, critical = _chi2(first, second, MODES[0])
    assert stat > 10 * critical, (stat, critical)


def test_greedy_decoding_keeps_the_argmax_chain():
    params = SamplingParams(temperature=0)
    first, second, accepted = _verified_pairs(params, _coupled)
    best = TABLE.argmax(-1)
    assert (first == best[START]).all() and (second == best[best[START]]).all()
    chain = _drafts()[:, 0] == best[START]
    assert torch.equal(accepted >= 1, chain)


def test_emitted_lengths_cut_after_the_first_stop():
    accepted = torch.tensor([0, 2, 2, 3, 1])
    stops = torch.tensor([[False, False, False, False],
                          [False, True, False, False],
                          [False, False, False, True],  # past the correction: not emitted
                          [False, False, False, True],
                          [True, True, False, False]])  # fmt: skip
    assert emitted_lengths(accepted, stops).tolist() == [1, 2, 3, 4, 1]


def test_accepted_lengths_stop_at_the_first_mismatch_and_the_row_length():
    sampled = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 3, 4], [7, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    lengths = torch.tensor([3, 3, 1, 3])
    assert accepted_lengths(sampled, drafts, lengths).tolist() == [3, 1, 1, 0]


# -- the rule for any draft distribution (a draft model's) --------------------------------------


def _model_drafted_pairs(params, resample_from_target=False):
    """Drafts drawn from a random draft distribution q per trial, verified by
    speculative_accept; the second token by a plain draw when only one came out."""
    generator = torch.Generator().manual_seed(5)
    target = allowed_probs_reference(TABLE, params).float()  # [prev, V]
    q = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator) * 2, -1)  # [prev, V]
    d1 = torch.multinomial(q[START].expand(TRIALS, VOCAB), 1, generator=generator).squeeze(-1)
    d2 = torch.multinomial(q[d1], 1, generator=generator).squeeze(-1)
    drafts = torch.stack([d1, d2], 1)
    target_probs = torch.stack([target[START].expand(TRIALS, VOCAB), target[d1], target[d2]], 1)
    draft_probs = torch.stack([q[START].expand(TRIALS, VOCAB), q[d1]], 1)
    if resample_from_target:  # wrong: a rejection draws from p, not the residual
        draft_probs = torch.zeros_like(draft_probs)
        keep_probs = torch.stack([target[START].expand(TRIALS, VOCAB), target[d1]], 1)
        picked_t = keep_probs.gather(-1, drafts[..., None]).squeeze(-1)
        picked_q = torch.stack([q[START][d1], q[d1, d2]], 1)
        u = torch.rand(picked_t.shape, generator=generator)
        accepted = (u * picked_q < picked_t).to(torch.int64).cumprod(1).sum(1)
        row = torch.arange(TRIALS)
        following = torch.multinomial(target_probs[row, accepted], 1, generator=generator)
        following = following.squeeze(-1)
    else:
        accepted, following = speculative_accept(target_probs, draft_probs, drafts, generator)
    first = torch.where(accepted >= 1, d1, following)
    after_first = torch.multinomial(target[first], 1, generator=generator).squeeze(-1)
    second = torch.where(accepted >= 2, d2, torch.where(accepted == 1, following, after_first))
    return first, second


@pytest.mark.parametrize("params", MODES[:3], ids=lambda p: str(p.mode_key()))
def test_speculative_accept_follows_the_target_distribution(params):
    stat, critical = _chi2(*_model_drafted_pairs(params), params)
    assert stat < critical, (stat, critical)


def test_resampling_from_the_target_instead_of_the_residual_fails_the_test():
    params = MODES[0]
    stat, critical = _chi2(*_model_drafted_pairs(params, resample_from_target=True), params)
    assert stat > 5 * critical, (stat, critical)


def test_speculative_accept_with_one_hot_drafts_accepts_with_the_target_probability():
    generator = torch.Generator().manual_seed(2)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    rows = 40000
    target = p.expand(rows, 2, 4)
    draft_probs = torch.zeros(rows, 1, 4)
    draft_probs[:, 0, 1] = 1.0  # the draft is token 1, deterministically
    drafts = torch.ones(rows, 1, dtype=torch.int64)
    accepted, following = speculative_accept(target, draft_probs, drafts, generator)
    assert abs(accepted.double().mean() - 0.3) < 0.01
    rejected = following[accepted == 0]
    assert (rejected != 1).all() and (rejected != 3).all()  # the residual: p without the draft
    assert abs((rejected == 0).double().mean() - 0.5 / 0.7) < 0.015
