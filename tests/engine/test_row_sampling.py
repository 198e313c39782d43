"""row_sampling.py: a batch whose rows ask for different settings samples, row by row, what
sampling.sample_reference draws for that row alone with its settings."""

from __future__ import annotations

import torch

from hybridflow.engine.row_sampling import mixed_mode, sample_rows
from hybridflow.engine.sampling import SamplingParams, sample_reference

SETTINGS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=40),
    SamplingParams(temperature=1.2, top_p=0.7),
    SamplingParams(temperature=0.9, top_k=100, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.8, top_p=0.95, min_p=0.02),
]


def test_each_row_samples_as_it_would_alone():
    vocab, repeats = 9000, 6  # three splits of the hierarchical draw
    generator = torch.Generator().manual_seed(0)
    settings = SETTINGS * repeats
    rows = len(settings)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    seed_lo = torch.randint(0, 2**32, (rows,), generator=generator)
    seed_hi = torch.randint(0, 2**32, (rows,), generator=generator)
    steps = torch.randint(0, 100, (rows,), generator=generator)
    modes = [s.mode_key() for s in settings]
    columns = [torch.tensor(c) for c in zip(*modes)]
    tokens, logprobs = sample_rows(logits, columns[0].float(), columns[1], columns[2].float(),
                                   columns[3].float(), seed_lo, seed_hi, steps,
                                   mixed_mode(modes))  # fmt: skip
    for row, params in enumerate(settings):
        one = slice(row, row + 1)
        token, logprob = sample_reference(logits[one], params, seed_lo[one], seed_hi[one],
                                          steps[one])  # fmt: skip
        assert tokens[row] == token[0], f"row {row}: {params}"
        torch.testing.assert_close(logprobs[row], logprob[0], rtol=0, atol=1e-6)
    assert len(set(tokens[1 :: len(SETTINGS)].tolist())) > 1  # the noise differs by seed


def test_the_mode_names_the_filters_any_row_uses():
    assert mixed_mode([(0.0, 50, 0.5, 0.3), (1.0, -1, 1.0, 0.0)]).mode_key() == (
        "rows",
        False,
        False,
    )
    assert mixed_mode([(1.0, 5, 1.0, 0.0), (0.5, -1, 1.0, 0.0)]).filters
    assert mixed_mode([(1.0, -1, 1.0, 0.1)]).min_p
