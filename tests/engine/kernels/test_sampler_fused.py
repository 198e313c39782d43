"""Fused hierarchical sampler (sampler_kernels.py) against the torch reference: same splits and
uniforms -> same tokens; distribution; seed reproducibility; the folded state update. Runs on
CUDA (marked gpu), or on CPU under TRITON_INTERPRET=1 when triton is installed (the
interpreter costs ~5 ms per program, so rows and splits are kept small); skipped otherwise."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine.kernels.sampler import sample_fused  # noqa: E402
from hybridflow.engine.sampling import (  # noqa: E402
    SamplingParams,
    allowed_probs_reference,
    request_seeds,
    sample_reference,
    split_seed,
)
from hybridflow.engine.state import DecodeState, advance  # noqa: E402

# CUDA's exp/log differ from torch's CPU ones in the last bits: a draw at a split or CDF
# boundary may flip there. The interpreter computes in numpy fp32: exact on these inputs.
MAX_FLIPS = 1 if DEVICE == "cuda" else 0


def _seeds(rows: int, base: int = 5):
    lo, hi = split_seed(request_seeds(base, rows, 1))
    return lo.to(DEVICE), hi.to(DEVICE)


PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=30, top_p=0.8, min_p=0.02),
]
PARAM_IDS = ["greedy", "T1", "T0.6", "topk", "minp", "topp", "all-filters"]


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
def test_fused_matches_reference_over_several_splits(params):
    """1000 tokens in splits of 256 (the last one 232 long, tiles of 128): identical tokens,
    log-probs equal to log_softmax(z) at the token (unfiltered), greedy = argmax."""
    rows = 24
    logits = torch.randn(rows, 1000, generator=torch.Generator().manual_seed(0)) * 3
    logits = logits.to(DEVICE)
    lo, hi = _seeds(rows)
    steps = torch.arange(rows, device=DEVICE)
    ref_tokens, ref_logprobs = sample_reference(logits, params, lo, hi, steps, split_size=256)
    tokens, logprobs = sample_fused(logits, params, lo, hi, steps, block_v=128, split_size=256)
    assert (tokens != ref_tokens).sum().item() <= MAX_FLIPS
    same = tokens == ref_tokens
    torch.testing.assert_close(logprobs[same], ref_logprobs[same], rtol=0, atol=1e-5)
    temperature = params.temperature or 1.0
    expected = torch.log_softmax(logits.double() / temperature, -1)
    expected = expected.gather(-1, tokens[:, None]).squeeze(-1).float()
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    allowed = allowed_probs_reference(logits, params) if not params.greedy else None
    if params.greedy:
        assert tokens.tolist() == logits.argmax(-1).tolist()
    else:
        assert (allowed.gather(-1, tokens[:, None]) > 0).all()  # never a filtered-out token
    assert len(set(tokens.tolist())) > 1 or params.greedy


def test_tile_size_does_not_change_the_draw_and_rows_are_independent():
    """block_v is an implementation detail (the scheme is fixed by the split size), and a row
    draws the same token wherever it sits in the batch (its uniforms hash its seed and step)."""
    rows = 12
    logits = (torch.randn(rows, 600, generator=torch.Generator().manual_seed(1)) * 2).to(DEVICE)
    lo, hi = _seeds(rows, base=9)
    steps = torch.full((rows,), 3, device=DEVICE)
    params = SamplingParams(temperature=0.9, top_k=50)
    a, _ = sample_fused(logits, params, lo, hi, steps, block_v=64, split_size=128)
    b, _ = sample_fused(logits, params, lo, hi, steps, block_v=128, split_size=128)
    assert (a != b).sum().item() <= MAX_FLIPS
    order = torch.arange(rows - 1, -1, -1, device=DEVICE)
    c, _ = sample_fused(logits[order], params, lo[order], hi[order], steps[order], 64, None, 128)
    assert c.flip(0).tolist() == a.tolist()
    d, _ = sample_fused(logits, params, lo, hi, steps + 1, block_v=64, split_size=128)
    assert (d != a).any()  # the next step draws fresh noise


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.15),
    ],
    ids=["topk5+topp0.8", "minp0.15"],
)
def test_fused_frequencies_match_distribution(params):
    """The distribution test of test_sampling.py, run through the kernel: 8 tokens in splits
    of 2 (4 splits), N = 192 draws (the interpreter's cost limits N). E[TV] <= 0.5 *
    sqrt(8 / N) = 0.10; we require TV < 0.2 and no filtered-out token, and the draws must be
    the reference's (whose frequencies test_sampling.py checks to TV < 0.02 on 40000)."""
    count = 192
    logits_row = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0], device=DEVICE)
    logits = logits_row.expand(count, -1)
    lo, hi = _seeds(count, base=7)
    steps = torch.zeros(count, dtype=torch.int64, device=DEVICE)
    tokens, _ = sample_fused(logits, params, lo, hi, steps, block_v=2, split_size=2)
    ref_tokens, _ = sample_reference(logits, params, lo, hi, steps, split_size=2)
    assert (tokens != ref_tokens).sum().item() <= MAX_FLIPS
    expected = allowed_probs_reference(logits_row[None], params)[0].cpu()
    empirical = torch.bincount(tokens.cpu(), minlength=8).double() / count
    tv = 0.5 * (empirical - expected).abs().sum().item()
    assert tv < 0.2, f"TV={tv:.4f} empirical={empirical} expected={expected}"
    assert empirical[expected == 0].sum() == 0


def _state_for_update_test(rows, vocab, lo, hi, stop_token=None) -> DecodeState:
    state = DecodeState(rows, num_slots=6, max_seq_len=8, vocab_size=vocab, device=DEVICE)
    state.seed_lo[:], state.seed_hi[:] = lo, hi
    state.row_slots[:] = torch.tensor([4, 0, 2, 1, 3])
    state.generated[:] = torch.tensor([1, 2, 3, 1, 5])
    state.positions[:] = torch.tensor([7, 8, 9, 10, 11])
    state.max_new[:] = torch.tensor([8, 3, 8, 8, 8])  # row 1 reaches max_new now
    state.finished[:] = torch.tensor([False, False, False, False, True])
    state.tokens[:] = 11
    if stop_token is not None:
        state.set_stop_tokens([stop_token])
    return state


def test_state_update_in_the_combine_kernel_matches_advance():
    """sample_fused(state=...) = sample_fused + state.advance: tokens and log-probs recorded
    per slot, counts, stop by stop token and by max_new, finished rows left alone. (Two
    states built the same way: a state holds a CUDA event, which does not copy.)"""
    rows, vocab = 5, 300
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)) * 2).to(DEVICE)
    params = SamplingParams(temperature=0.8, top_k=3)
    lo, hi = _seeds(rows, base=3)
    probe = _state_for_update_test(rows, vocab, lo, hi)
    expected_tokens, _ = sample_fused(logits, params, lo, hi, probe.generated.clone(), 128)
    stop = int(expected_tokens[2])  # row 2 emits a stop token
    state = _state_for_update_test(rows, vocab, lo, hi, stop)
    reference = _state_for_update_test(rows, vocab, lo, hi, stop)
    tokens, logprobs = sample_fused(logits, params, lo, hi, reference.generated.clone(), 128)
    advance(reference, rows, tokens, logprobs)
    assert sample_fused(logits, params, lo, hi, state.generated, 128, state=state) is None
    for name in ("tokens", "positions", "generated", "finished", "out_tokens", "out_logprobs"):
        assert torch.equal(getattr(state, name), getattr(reference, name)), name
    assert state.finished.tolist() == [False, True, True, False, True]
