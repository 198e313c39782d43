"""Verify passes (speculative/verify.py) in the engine, CPU fp32 eager: with speculation on,
every request emits the tokens and log-probs the engine emits without it, greedy and sampled,
in a slot and a paged cache (rejected drafts' K/V left past each row's end never change a
later token, nor a kept slot's next turn), while drafts are accepted; and the options are
checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.serving.service import RolloutService
from hybridflow.engine.speculative.verify import Speculation

EAGER = dict(decode_backend="torch", cuda_graphs=False, steps_per_sync=4)
# the rule "always": verify every tail step with a draft (the measured rule: test_rule.py)
SPECULATIVE = dict(speculative="ngram", speculative_draft_tokens=4, speculative_max_rows=64,
                   speculative_rule="always")  # fmt: skip
# repetitive prompts (prompt lookup drafts), of different lengths
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41, 42, 40, 41], list(range(60, 80)) * 2, [12, 13]]


def _engine(model, speculative: bool, block=None, slots=8, **extra) -> Engine:
    fields = {**EAGER, **(SPECULATIVE if speculative else {}), **extra}
    return Engine(model, slots, 128, options=EngineOptions(**fields, kv_block_size=block))


def _assert_same(got, expected):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected):  # other matmul shapes: equal up to fp32 rounding
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block", [None, 16])
def test_greedy_tokens_equal_the_engine_without_speculation(model, block):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True)
    budgets = [40, 12, 40, 25, 33, 40, 7, 40]  # rows leave at different steps
    expected = _engine(model, False, block).generate(PROMPTS, params, max_new_tokens=budgets)
    engine = _engine(model, True, block)
    _assert_same(engine.generate(PROMPTS, params, max_new_tokens=budgets), expected)
    stats = engine.speculation.stats
    assert stats.passes > 0 and stats.accepted > 0
    # a second epoch of the same prompts: the first epoch's responses draft (the store)
    before = (stats.rows, stats.emitted)
    _assert_same(engine.generate(PROMPTS, params, max_new_tokens=budgets), expected)
    rows, emitted = stats.rows - before[0], stats.emitted - before[1]
    assert emitted / rows > 3.5  # 4 drafts: nearly all accepted
    if block is not None:
        assert engine.blocks.free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize(
    "params",
    [SamplingParams(n=3, temperature=0.9, max_new_tokens=30, seed=3, ignore_eos=True),
     SamplingParams(n=2, temperature=0.6, top_k=8, top_p=0.9, max_new_tokens=30, seed=4,
                    stop_token_ids=(17, 41))],
    ids=["temperature", "filters+stops"],
)  # fmt: skip
def test_sampled_tokens_equal_the_engine_without_speculation_for_a_seed(model, params):
    expected = _engine(model, False, 16).generate(PROMPTS, params)
    engine = _engine(model, True, 16, speculative_min_ngram=1)
    _assert_same(engine.generate(PROMPTS, params), expected)
    # again (the same seed, so the same tokens): the first call's responses draft them
    _assert_same(engine.generate(PROMPTS, params), expected)
    stats = engine.speculation.stats
    assert stats.passes > 0 and stats.accepted > 0


def test_verify_passes_take_turns_with_mixed_steps(model):
    """Four slots for eight requests: prompts are prefilled in mixed steps while rows
    decode, and verify passes run between them."""
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24, ignore_eos=True)
    budgets = [24, 5, 9, 24, 14, 7, 24, 11]
    expected = _engine(model, False).generate(PROMPTS, params, max_new_tokens=budgets)
    engine = _engine(model, True, slots=4, max_prefill_tokens_per_step=8,
                     speculative_min_ngram=1)  # fmt: skip
    _assert_same(engine.generate(PROMPTS, params, max_new_tokens=budgets), expected)
    assert engine.scheduler.mixed_steps > 0 and engine.speculation.stats.passes > 0


def test_a_kept_slot_continues_as_without_speculation(model):
    """A rejected draft's K/V stays past the row's end in its slot: the next turn, extending
    the kept slot, must not read it."""
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    results = {}
    for speculative in (False, True):
        engine = _engine(model, speculative, 16)
        first = engine.generate(PROMPTS, params, keep=True)
        turns = [p + c.token_ids + [7, 8] for p, c in zip(PROMPTS, first)]
        second = engine.generate(turns, params, reuse=[c.kv_handle for c in first])
        results[speculative] = first + second
    _assert_same(results[True], results[False])


def test_rows_past_the_tail_decode_in_chunks(model):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=20, ignore_eos=True)
    engine = _engine(model, True, speculative_max_rows=1)
    expected = _engine(model, False).generate(PROMPTS, params)
    _assert_same(engine.generate(PROMPTS, params), expected)
    assert engine.speculation.stats.rows == engine.speculation.stats.passes  # one row a pass


def test_service_requests_with_different_settings_sample_as_alone(model):
    """Rows of one verify pass that sample differently (row_sampling.py: each position with
    its row's settings) emit what each request emits alone without speculation."""
    settings = [
        SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, max_new_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, max_new_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.1, max_new_tokens=25, ignore_eos=True),
    ]
    expected = [_engine(model, False).generate([p], params, seeds=[i])[0]
                for i, (p, params) in enumerate(zip(PROMPTS, settings))]  # fmt: skip
    engine = _engine(model, True, speculative_min_ngram=1)
    with RolloutService(engine) as service:
        for _ in range(2):  # the second round drafts from the first's responses
            handles = [service.submit(p, params, seed=i)
                       for i, (p, params) in enumerate(zip(PROMPTS, settings))]  # fmt: skip
            _assert_same([h.result(timeout=120)[0] for h in handles], expected)
    assert engine.speculation.stats.accepted > 0


def _row(key: int, prompt: list[int], tokens: list[int]):
    sub = SimpleNamespace(prompt_of=lambda request: prompt, aborted=set())
    return SimpleNamespace(key=key, sub=sub, request=0, tokens=tokens)


def test_drafts_follow_siblings_then_the_row_and_keep_indexes_of_decoding_rows_only():
    speculation = Speculation(EngineOptions(speculative="ngram", speculative_draft_tokens=3))
    prompt = [1, 2, 3, 4, 1, 2]
    speculation.finished(_row(0, prompt, [9, 8, 7, 6]))  # a sibling that finished
    rows = [_row(1, prompt, [9]), _row(2, prompt, [5, 3, 4, 1]), _row(3, [7, 7], [7])]
    drafts = speculation.drafts(rows, [10, 10, 2])
    # the sibling's (1, 2, 9) beats the prompt's (1, 2, 3); (3, 4, 1) only the prompt has;
    # a row that may emit 2 more tokens drafts 1
    assert drafts == {1: [8, 7, 6], 2: [2, 5, 3], 3: [7]}
    assert speculation.drafts(rows[1:], [10, 10]) == {2: [2, 5, 3], 3: [7]}
    assert set(speculation.contexts) == {2, 3}  # row 1 left (a reset scheduler's request)


@pytest.mark.parametrize(
    ("fields", "message"),
    [(dict(speculative="eagle"), "speculative='eagle': must be one of off, ngram, draft"),
     (dict(speculative="ngram", speculative_draft_tokens=9),
      "speculative_draft_tokens=9: at most steps_per_sync=8"),
     (dict(speculative_draft_tokens=0), "speculative_draft_tokens=0: must be an integer >= 1"),
     (dict(speculative_max_rows=0), "speculative_max_rows=0: must be an integer >= 1"),
     (dict(speculative_min_ngram=3, speculative_max_ngram=2), "1 <= min <= max <= 16"),
     (dict(speculative_store_tokens=-1), "speculative_store_tokens=-1: must be an integer >= 0"),
     (dict(speculative="draft"), "speculative='draft' needs speculative_draft_model"),
     (dict(speculative_draft_model=3), "speculative_draft_model=3: a preset name or a directory"),
     (dict(speculative_rule="sometimes"), "speculative_rule='sometimes': must be one of measured, always"),
     (dict(speculative_margin=-0.1), "speculative_margin=-0.1: must be a number >= 0"),
     (dict(speculative_margin=float("nan")), "speculative_margin=nan: must be a number >= 0"),
     (dict(speculative_probe_steps=0), "speculative_probe_steps=0: must be an integer >= 1")],
)  # fmt: skip
def test_speculative_options_are_checked(fields, message):
    with pytest.raises(ValueError, match="invalid engine options") as raised:
        EngineOptions(**fields).checked()
    assert message in str(raised.value)


def test_draft_tokens_past_steps_per_sync_matter_only_with_speculation_on():
    assert EngineOptions(steps_per_sync=2, speculative_draft_tokens=4).validate() == []
