"""Verify passes in models with per-sequence cache kinds (speculative/rollback.py), CPU fp32
eager: a Gated DeltaNet model (tiny-hybrid: recurrent conv and SSM states) and a sliding
one (tiny-gpt-oss: a ring of 8 positions) emit with speculation the tokens they emit without
it, greedy and sampled, in a slot and a paged cache, with n-gram drafts and a draft model,
and a kept slot's next turn continues from the right state: the rows that rejected drafts
get their states back and move through the inputs they kept."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

EAGER = dict(decode_backend="torch", cuda_graphs=False, steps_per_sync=4)
NGRAM = dict(speculative="ngram", speculative_min_ngram=1, speculative_max_rows=64,
             speculative_rule="always")  # fmt: skip
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41, 42, 40, 41], list(range(60, 80)) * 2, [12, 13]]
GREEDY = SamplingParams(n=2, temperature=0, max_new_tokens=30, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_new_tokens=30, seed=3,
                         ignore_eos=True)  # fmt: skip


def _model(preset: str):
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config(preset), seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias") and p.dim() > 1:
            p.normal_(0, 0.3, generator=generator)
    return model


@pytest.fixture(scope="module", params=["tiny-hybrid", "tiny-gpt-oss"])
def per_sequence(request):
    return _model(request.param)


def _engine(model, block=None, **speculative) -> Engine:
    return Engine(model, 8, 128, options=EngineOptions(**EAGER, **speculative, kv_block_size=block))


def _assert_same(got, expected):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):  # a recurrence run in chunks rounds otherwise
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=2e-4)


@pytest.mark.parametrize(("params", "block"), [(GREEDY, None), (SAMPLED, 16)],
                         ids=["greedy-slots", "sampled-paged"])  # fmt: skip
def test_ngram_speculation_emits_the_tokens_of_the_plain_engine(per_sequence, params, block):
    expected = _engine(per_sequence, block).generate(PROMPTS, params)
    engine = _engine(per_sequence, block, **NGRAM)
    for _ in range(2):  # the second call drafts from the first's responses
        _assert_same(engine.generate(PROMPTS, params), expected)
    stats = engine.speculation.stats
    assert 0 < stats.accepted < stats.drafted  # rows rolled back, rows kept every draft


def test_a_kept_slot_continues_from_its_rolled_back_state(per_sequence):
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    results = {}
    for speculative in ({}, NGRAM):
        engine = _engine(per_sequence, 16, **speculative)
        first = engine.generate(PROMPTS, params, keep=True)
        assert all(c.kv_handle is not None for c in first)
        turns = [p + c.token_ids + [7, 8] for p, c in zip(PROMPTS, first)]
        second = engine.generate(turns, params, reuse=[c.kv_handle for c in first])
        results[bool(speculative)] = first + second
    _assert_same(results[True], results[False])


def test_a_draft_model_speculates_for_a_hybrid_model(tmp_path, model):
    """The conftest's attention model drafts (the same vocabulary) for tiny-hybrid."""
    model.save_pretrained(str(tmp_path))
    hybrid = _model("tiny-hybrid")
    expected = _engine(hybrid).generate(PROMPTS, GREEDY)
    engine = _engine(hybrid, speculative="draft", speculative_draft_model=str(tmp_path),
                     speculative_max_rows=64, speculative_rule="always")  # fmt: skip
    _assert_same(engine.generate(PROMPTS, GREEDY), expected)
    assert engine.speculation.stats.passes > 0
